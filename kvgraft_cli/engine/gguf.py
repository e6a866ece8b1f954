"""Dequantize a GGUF once, through transformers' GGUF support, into a safetensors checkpoint kvgraft loads.

The conversion is deterministic: the same GGUF (and the same pinned transformers, gguf and torch) gives the same
bytes every time, so a manifest pins the dequantized model's hash beside the GGUF's and any machine can rebuild and
check it. What makes it so: the weights are written with safetensors' own ``save_file`` (tensors sorted by name,
fixed metadata), a tied output head is left out (transformers ties it again on load, as the GGUF ties it), and
config.json is written with sorted keys and without the loader's ``quantization_config``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import gguf as gguf_config
from ..errors import InputError, UnsupportedModel
from ..util.fsio import fsync_dir

if TYPE_CHECKING:
    from ..config.modelhash import ModelHashes

DTYPES = ("float32", "bfloat16")


def supported_architectures() -> list[str]:
    """The GGUF architectures transformers' loader converts."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return list(GGUF_SUPPORTED_ARCHITECTURES)


def check_gguf(path: Path) -> gguf_config.GGUFInfo:
    """:func:`config.gguf.read_gguf`, then transformers' list of convertible architectures (imported only for a
    file whose header passed: it imports torch)."""
    info = gguf_config.read_gguf(path)
    gguf_config.check_architecture(info, supported_architectures())
    return info


def dequantize(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Convert ``gguf_path`` into a checkpoint directory ``out_dir`` (config.json, model.safetensors, tokenizer
    files) in ``dtype``. Written beside ``out_dir`` and renamed into place: an interrupted conversion leaves no
    half-written model. Refuses (before writing) what :func:`check_gguf` refuses. Returns ``out_dir``."""
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r}: a GGUF converts to {' or '.join(DTYPES)}")
    gguf_path = Path(gguf_path)
    check_gguf(gguf_path)
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:  # what the header check cannot see
        raise UnsupportedModel(
            f"{gguf_path}: transformers cannot convert this GGUF ({type(e).__name__}: {str(e)[:200]})",
            "use a GGUF of a supported architecture and quantization",
        ) from None
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            # Tied: one tensor under two names; safetensors stores it once, transformers ties it again on load.
            for key in [k for k in state if k.endswith("lm_head.weight")]:
                del state[key]
        save_file(dict(sorted(state.items())), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the GGUF loader's, not the checkpoint's: it would load as GGUF again
        cfg.pop("_name_or_path", None)  # the folder the GGUF was read from: another machine's path, other bytes
        cfg["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tokenizer.save_pretrained(str(tmp))
        for leftover in ("generation_config.json",):
            (tmp / leftover).unlink(missing_ok=True)
        for f in tmp.iterdir():
            f.chmod(0o644)  # a cache others may read, like any checkpoint (mkstemp/mkdtemp make them private)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        tmp.chmod(0o755)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "model.safetensors").is_file():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first: keep theirs (same bytes)
            return out_dir
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def materialize(manifest) -> None:
    """Make sure a GGUF manifest's dequantized checkpoint is in the cache, converting the GGUF once (after checking
    its SHA-256 against ``model.gguf_sha256``). The model hash of what was written is checked by the caller, as for
    any checkpoint (engine.load_engine). Nothing to do for a checkpoint directory."""
    from ..errors import IntegrityError
    from ..util.hashing import sha256_file

    model = manifest.model
    if not gguf_config.is_gguf_path(model.path):
        return
    out = gguf_config.dequantized_dir(model.gguf_sha256, model.dtype)
    if (out / "model.safetensors").is_file():
        return
    path = manifest.gguf_path
    got = sha256_file(path)
    gguf_config.check_known(model.path, got)
    if got != model.gguf_sha256:
        raise IntegrityError(
            f"{path}: the GGUF's SHA-256 is {got}, the manifest {manifest.source} pins {model.gguf_sha256}",
            "use the GGUF the manifest was written for, or write a new manifest for this one (`kvgraft manifest init`)",
        )
    dequantize(path, out, model.dtype)


def manifest_for_gguf(source: str, output: Path | None, **settings) -> tuple[str, ModelHashes]:
    """The YAML text of a pinned manifest for a GGUF (``package:DIST`` or a .gguf path), and the dequantized model's
    hashes. The GGUF is checked, hashed and (once) dequantized into the cache; a file path is written relative to
    the folder of ``output``, as checkpoint directories are."""
    from ..config.manifest import dump_yaml, make_manifest
    from ..config.modelhash import has_chat_template, hash_model_dir
    from ..util.hashing import sha256_file

    path = gguf_config.resolve_gguf(source, Path.cwd())
    dtype = settings.get("dtype", "float32")
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype}: a GGUF converts to {' or '.join(DTYPES)}")
    check_gguf(path)
    sha = sha256_file(path)
    gguf_config.check_known(source, sha)
    out = gguf_config.dequantized_dir(sha, dtype)
    if not (out / "model.safetensors").is_file():
        dequantize(path, out, dtype)
    hashes = hash_model_dir(out)
    header = "# kvgraft run-manifest, written by `kvgraft manifest init`\n"
    if settings.pop("weights", "dequantized") == "q4":
        from .quantized import weights_sha256

        if settings.get("device", "cpu") != "cpu":
            raise InputError("--weights q4 runs on torch's CPU kernels", "use --device cpu, or --weights dequantized")
        settings["weights_sha256"], kept = weights_sha256(path, out, dtype, gguf_config.quantized_path(sha))
        header += f"# model.weights q4: {kept}\n"
    if source.startswith(gguf_config.PACKAGE_PREFIX):
        model_path = source
    else:
        base = Path(output).resolve().parent if output else Path.cwd()
        model_path = os.path.relpath(path.resolve(), base)
    settings.setdefault("name", f"{path.stem}-{settings.get('profile', 'portable')}-{settings.get('device', 'cpu')}")
    data = make_manifest(
        model_path,
        hashes.model_sha256,
        hashes.tokenizer_sha256,
        gguf_sha256=sha,
        chat=has_chat_template(out),
        **settings,
    )
    return header + dump_yaml(data), hashes
