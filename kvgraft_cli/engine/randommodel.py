"""Random-weight models drawn directly on their device, wrapped in a pinned Engine: for models too large to write
to disk or to build on the host first (scripts/scale_exactness.py at 12B and 29B parameters on a GPU,
benchmarks/bench_graft.py). The model's identity in the manifest is the SHA-256 of its config.json, the byte-level
tokenizer's files and a line naming how the weights were drawn (seed, dtype, device, torch build): the same torch
build on the same device draws the same weights."""

from __future__ import annotations

from pathlib import Path


def random_engine(
    name: str,
    config,
    workdir: Path,
    *,
    device: str,
    dtype: str,
    profile: str,
    seed: int = 0,
    threads: int | None = None,
):
    """A pinned Engine around a random-weight model of ``config`` drawn with ``seed`` directly on ``device``
    (engine_from_model), its manifest written under ``workdir`` (with config.json and the tokenizer). The
    profile's kernel flags must already be in force: the caller applies them before torch is imported. ``threads``
    as in make_manifest (None: the profile's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..config.manifest import dump_yaml, load_manifest, make_manifest
    from ..config.modelhash import CONFIG_FILES, TOKENIZER_FILES, ModelHashes, listing
    from ..util.hashing import sha256_bytes, sha256_file
    from ..util.memory import keep_freed_memory
    from . import determinism
    from .engine import engine_from_model
    from .tinymodel import tiny_tokenizer

    model_dir = workdir / f"{name}-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(model_dir)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(model_dir)
    # The files a checkpoint's hash covers (config.modelhash), the weights replaced by how they were drawn.
    files = {n: sha256_file(model_dir / n) for n in (*CONFIG_FILES, *TOKENIZER_FILES) if (model_dir / n).is_file()}
    tok = {n: h for n, h in files.items() if n in TOKENIZER_FILES}
    # A GPU's random numbers depend on its launch grid (its number of SMs): the GPU's name is part of the draw.
    gpu = determinism.visible_gpu_name() if device == "cuda" else None
    files["(weights)"] = sha256_bytes(
        f"random, torch.manual_seed({seed}), {dtype}, drawn on {gpu or device}, torch {torch.__version__}".encode()
    )
    hashes = ModelHashes(sha256_bytes(listing(files).encode()), sha256_bytes(listing(tok).encode()), files)
    data = make_manifest(
        str(model_dir),
        hashes.model_sha256,
        hashes.tokenizer_sha256,
        profile=profile,
        device=device,
        dtype=dtype,
        threads=threads,
        gpu_name=gpu,
        name=f"random-{name}-{dtype}-{profile}-{device}",
    )
    (workdir / f"{name}.yaml").write_text(dump_yaml(data), encoding="utf-8")
    manifest = load_manifest(workdir / f"{name}.yaml")
    drift = determinism.apply_environment(manifest.runtime.env, manifest.runtime.device)
    dev = determinism.configure_torch(manifest.runtime, drift)
    drift.enforce(False, manifest.source)
    keep_freed_memory()  # as load_engine: a forward's temporaries reuse freed heap (util.memory)
    torch.manual_seed(seed)
    with dev:  # drawn where it runs: a 29B model never passes through host memory
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="eager")
    return engine_from_model(manifest, model, tokenizer, dev, hashes, drift)
