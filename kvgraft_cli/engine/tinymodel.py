"""The embedded default model: a tiny, randomly initialised Gemma-4 text model with a byte-level tokenizer.

Deterministic: the same torch/transformers versions and seed give the same weight bytes. The output is a normal
Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that loads
with the Auto classes and ``local_files_only=True``, exactly like a real local checkpoint. Tests use
:func:`write_tiny_model` with other seeds or configs to get "another model".
"""

from __future__ import annotations

from pathlib import Path

# Byte-level vocabulary: 4 special tokens, then one token per byte value (ids 4..259).
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
SEED = 20261130


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token, so any text encodes losslessly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for raw bytes (GPT-2 scheme)
    byte_map = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b in range(256):
        vocab[byte_map[b]] = len(SPECIALS) + b
    assert set(alphabet) == set(byte_map.values())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def tiny_tokenizer():
    """The byte-level tokenizer as a transformers tokenizer, with the special tokens named (what a checkpoint
    directory saves)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2 byte-to-printable-character table (what the ByteLevel pre-tokenizer emits).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_config(**overrides):
    """The embedded model's Gemma-4 text config; keyword arguments replace fields (tests vary the layout)."""
    from transformers import Gemma4TextConfig

    kwargs = dict(
        vocab_size=len(SPECIALS) + 256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=32,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        vocab_size_per_layer_input=len(SPECIALS) + 256,
        hidden_size_per_layer_input=8,
        max_position_embeddings=32768,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return Gemma4TextConfig(**kwargs)


def write_tiny_model(out: Path, seed: int = SEED, config=None, dtype: str = "float32") -> Path:
    """Write a random-weight checkpoint (default: the embedded Gemma-4) to ``out`` with weights in ``dtype``;
    returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config if config is not None else build_config()
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    # generation_config.json is not needed by kvgraft (decode settings come from the manifest).
    (out / "generation_config.json").unlink(missing_ok=True)
    for p in out.iterdir():
        p.chmod(0o644)  # save_pretrained writes weights 0600; the package ships them world-readable
    return out
