"""Model and tokenizer hashes: SHA-256 over a canonical listing of (relative path, SHA-256 of file).

The listing is exactly what ``sha256sum`` prints for the files, sorted by path (``<hex>  <relpath>\\n`` per line),
so a third party can rebuild it with coreutils: ``(cd MODEL && sha256sum FILES | sort -k2) | sha256sum``.
Per-file hashes of weight files equal the hub's LFS ``sha256`` for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, UnsupportedModel
from ..util.hashing import sha256_bytes, sha256_file

# Files that define the tokenizer (whichever of them a checkpoint has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
CONFIG_FILES = ("config.json",)
# The most characters a text may have per position of the model before kvgraft refuses it untokenized (engine.encode,
# eval.problems.check_lengths): generous, since text averages 3-5 characters a token (code and math 2-4; a byte-level
# tokenizer 1 or less) and only runs of spaces or dashes reach tens of characters in a single token. Tokenizing is
# then bounded: about 225 bytes of memory per character with a byte-level tokenizer, far less with a real one.
CHARS_PER_TOKEN = 32
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ModelHashes:
    """The hashes that pin a model directory."""

    model_sha256: str
    tokenizer_sha256: str
    files: dict[str, str]  # relative path -> sha256

    def listing(self) -> str:
        """The canonical listing whose SHA-256 is the model hash."""
        return listing(self.files)


def listing(files: dict[str, str]) -> str:
    """``sha256sum``-style lines, sorted by relative path (byte order of the UTF-8 path)."""
    return "".join(f"{h}  {p}\n" for p, h in sorted(files.items(), key=lambda kv: kv[0].encode()))


def model_files(model_dir: Path) -> list[str]:
    """The relative paths that take part in the model hash: weights (safetensors), config and tokenizer files."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"model directory not found: {model_dir}", "point model.path at a local checkpoint directory")
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    weights = [n for n in names if n.endswith(".safetensors") or n.endswith(".safetensors.index.json")]
    if not any(n.endswith(".safetensors") for n in weights):
        pickled = [n for n in names if n.endswith(PICKLE_WEIGHTS)]
        if pickled:
            raise UnsupportedModel(
                f"{model_dir}: weights are pickled ({', '.join(pickled)}); kvgraft loads safetensors only",
                "convert the checkpoint to safetensors (save_pretrained(..., safe_serialization=True))",
            )
        raise InputError(f"{model_dir}: no *.safetensors weights found", "is this a Hugging Face checkpoint directory?")
    missing = [n for n in CONFIG_FILES if n not in names]
    if missing:
        raise InputError(f"{model_dir}: missing {', '.join(missing)}")
    return weights + [n for n in names if n in CONFIG_FILES or n in TOKENIZER_FILES]


def hash_model_dir(model_dir: Path) -> ModelHashes:
    """Hash a model directory (see module docstring). Reads every weight byte: seconds per GB."""
    model_dir = Path(model_dir)
    files = {name: sha256_file(model_dir / name) for name in model_files(model_dir)}
    tok = {n: h for n, h in files.items() if n in TOKENIZER_FILES}
    if not tok:
        raise InputError(f"{model_dir}: no tokenizer files found ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    return ModelHashes(
        model_sha256=sha256_bytes(listing(files).encode()),
        tokenizer_sha256=sha256_bytes(listing(tok).encode()),
        files=files,
    )


def tokenizer_sha256(model_dir: Path) -> str | None:
    """The tokenizer hash of :func:`hash_model_dir` alone, reading only the tokenizer files (no weights); None when
    the folder has none. (OSError when one cannot be read.)"""
    model_dir = Path(model_dir)
    tok = {n: sha256_file(model_dir / n) for n in TOKENIZER_FILES if (model_dir / n).is_file()}
    return sha256_bytes(listing(tok).encode()) if tok else None


def context_window(model_dir: Path) -> int | None:
    """The model's position limit read from its config.json (``max_position_embeddings``, also inside a
    multimodal ``text_config``, or GPT-2's ``n_positions``), without loading the model; None if it names none."""
    import json

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(c.get(key), int) and c[key] > 0:
                return c[key]
    return None


def has_chat_template(model_dir: Path) -> bool:
    """Whether a checkpoint's tokenizer ships a chat template (chat_template.jinja, or in tokenizer_config.json)."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    import json

    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        return isinstance(config, dict) and bool(config.get("chat_template"))
    except (OSError, ValueError):
        return False
