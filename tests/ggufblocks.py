"""GGUF pieces for tests: blocks of the k-quant types (gguf has no quantizer for them; test_quantized.py's decoding
checks, test_gguf.py's small mixed GGUF) and a tiny Llama GGUF built like SmolLM2's (test_gguf.py, test_batching.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def k_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K blocks [rows, bytes] (gguf has no quantizer for them): every field random, which any bytes are
    (codes, 6-bit scales and minimums, Q6_K's signed 8-bit scales), but the float16 factors, set to the magnitudes a
    quantizer writes (and their extremes: the largest codes and scales below)."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    factors = (rng.random((blocks.shape[0], 2)) * 2e-3 + 1e-4).astype(np.float16)
    if kind != "Q6_K":
        blocks[:, 0:4] = factors.view(np.uint8)  # d, dmin
    else:
        blocks[:, 208:210] = factors[:, :1].view(np.uint8)  # d
        blocks[0, 192:194] = (0x80, 0x7F)  # scales -128 and 127 ...
        blocks[0, :16] = 0  # ... over codes of -32 (low nibbles 0, high bits 0)
        blocks[0, 128:132] = 0
    return blocks.reshape(rows, -1)


def tiny_llama(path: Path, kinds: dict[str, str] | None = None, hidden: int = 64, ffn: int = 128) -> Path:
    """A llama GGUF of about 34 KB built like the real SmolLM2 one, the same code path at a thousandth of the cost:
    one layer, Q4_1 projections (or the GGUF types ``kinds`` names, by tensor: ``{"attn_v": "Q6_K"}``), a Q8_0
    embedding tied to the output head, F32 norms, a byte-level BPE (gpt2) tokenizer with merges and ChatML's special
    tokens, a chat template. Weights from a seeded generator."""
    q = gguf.GGMLQuantizationType
    heads, kv_heads = 2, 1  # Q4_1 and Q8_0 quantize rows in blocks of 32; k-quants in 256
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ", "Ġt", "he", "Ġthe", "in"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("kvgraft tiny llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    rng = np.random.default_rng(0)

    def add(name: str, shape: tuple[int, ...], qtype) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if qtype in (q.F32, q.F16):
            w.add_tensor(name, data.astype(np.float16) if qtype == q.F16 else data)
        elif qtype.name.endswith("_K"):
            blocks = k_blocks(qtype.name, *shape, rng)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        else:
            packed = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), hidden), q.Q8_0)
    add("output_norm.weight", (hidden,), q.F32)
    add("blk.0.attn_norm.weight", (hidden,), q.F32)
    add("blk.0.ffn_norm.weight", (hidden,), q.F32)
    head = hidden // heads
    for name, shape in [
        ("attn_q", (hidden, hidden)),
        ("attn_k", (kv_heads * head, hidden)),
        ("attn_v", (kv_heads * head, hidden)),
        ("attn_output", (hidden, hidden)),
        ("ffn_gate", (ffn, hidden)),
        ("ffn_up", (ffn, hidden)),
        ("ffn_down", (hidden, ffn)),
    ]:
        add(f"blk.0.{name}.weight", shape, getattr(q, (kinds or {}).get(name, "Q4_1")))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
