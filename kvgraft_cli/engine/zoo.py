"""A zoo of tiny, seeded causal LMs, one per supported architecture, for the exactness matrix, the probe and tests.

Each entry builds a Hugging Face config small enough to run in milliseconds on a CPU (no download) but with the
architecture's real cache layout: full-attention, sliding-window and mixed layers, rotary or learned absolute
positions. :func:`tiny_manifest` writes the checkpoint and a pinned manifest for it, so a tiny model goes through
exactly the same engine path (hash check, pins, load) as a real one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from .tinymodel import SPECIALS, build_config

VOCAB = len(SPECIALS) + 256
SEED = 1  # weights seed for the zoo (the embedded model has its own)
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


@dataclass(frozen=True)
class TinyArch:
    """One architecture: how to build its tiny config, the cache layout it must produce, how it encodes position."""

    name: str
    make_config: Callable[[], Any]
    layer_kinds: tuple[str, ...]
    positions: str  # "rotary" or "learned"


def _llama():
    import transformers as T

    return T.LlamaConfig(**_COMMON)


def _mistral():
    import transformers as T

    return T.MistralConfig(**_COMMON, sliding_window=16)


def _qwen2():
    import transformers as T

    return T.Qwen2Config(**_COMMON)


def _qwen3():
    import transformers as T

    return T.Qwen3Config(**_COMMON, head_dim=8)


def _gemma2():
    import transformers as T

    return T.Gemma2Config(**_COMMON, head_dim=8, sliding_window=16)


def _gemma3():
    import transformers as T

    return T.Gemma3TextConfig(
        **_COMMON, head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"]
    )


def _phi3():
    import transformers as T

    return T.Phi3Config(**_COMMON)


def _olmo2():
    import transformers as T

    return T.Olmo2Config(**_COMMON)


def _gpt2():
    import transformers as T

    return T.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=2, eos_token_id=1
    )


ARCHS: dict[str, TinyArch] = {
    a.name: a
    for a in (
        TinyArch("llama", _llama, ("full", "full"), "rotary"),
        TinyArch("mistral", _mistral, ("sliding", "sliding"), "rotary"),
        TinyArch("qwen2", _qwen2, ("full", "full"), "rotary"),
        TinyArch("qwen3", _qwen3, ("full", "full"), "rotary"),
        TinyArch("gemma2", _gemma2, ("sliding", "full"), "rotary"),
        TinyArch("gemma3", _gemma3, ("sliding", "full"), "rotary"),
        TinyArch("gemma4", build_config, ("sliding", "sliding", "sliding", "full"), "rotary"),
        TinyArch("phi3", _phi3, ("full", "full"), "rotary"),
        TinyArch("olmo2", _olmo2, ("full", "full"), "rotary"),
        TinyArch("gpt2", _gpt2, ("full", "full"), "learned"),
    )
}


def get_arch(name: str) -> TinyArch:
    """The zoo entry called ``name`` (InputError naming the choices otherwise)."""
    try:
        return ARCHS[name]
    except KeyError:
        raise InputError(f"unknown architecture {name!r}", f"choose from {', '.join(ARCHS)}") from None


def tiny_manifest(
    arch: str,
    workdir: Path,
    *,
    dtype: str = "float32",
    profile: str = "portable",
    device: str = "cpu",
    attn_implementation: str = "eager",
    threads: int | None = None,
    gpu_name: str | None = None,
    sdpa_backend: str | None = None,
    schedule: str = "single",
    kv_dtype: str | None = None,
):
    """Write ``arch``'s tiny checkpoint under ``workdir`` (reused when already there) and a pinned manifest for it.

    Returns the loaded :class:`~kvgraft_cli.manifest.Manifest`. Import order matters: call this before torch is
    imported only if nothing else imported it, since writing the checkpoint imports torch (the caller pins the
    environment first, see :func:`kvgraft_cli.engine.pin_environment`).
    """
    from ..config.manifest import dump_yaml, load_manifest, make_manifest
    from ..config.modelhash import hash_model_dir
    from .tinymodel import write_tiny_model

    spec = get_arch(arch)
    model_dir = workdir / f"{arch}-model"
    if not (model_dir / "config.json").exists():
        import transformers

        transformers.utils.logging.disable_progress_bar()
        write_tiny_model(model_dir, seed=SEED, config=spec.make_config())
    h = hash_model_dir(model_dir)
    data = make_manifest(
        str(model_dir.resolve()),
        h.model_sha256,
        h.tokenizer_sha256,
        profile=profile,
        device=device,
        dtype=dtype,
        attn_implementation=attn_implementation,
        threads=threads,
        gpu_name=gpu_name,
        sdpa_backend=sdpa_backend,
        schedule=schedule,
        kv_dtype=kv_dtype,
        name=f"tiny-{arch}-{dtype}-{profile}-{device}",
    )
    kv = f"-kv{kv_dtype}" if kv_dtype else ""
    path = workdir / f"{arch}-{dtype}-{profile}-{device}-{attn_implementation}{sdpa_backend or ''}-{schedule}{kv}.yaml"
    path.write_text(dump_yaml(data), encoding="utf-8")
    return load_manifest(path)
