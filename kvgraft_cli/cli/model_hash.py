"""`kvgraft model-hash`: a model directory's per-file SHA-256 listing, model and tokenizer hashes."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ._common import JSON_OPT
from ._output import print_json


def model_hash(
    model_dir: Path = typer.Argument(..., help="Local model directory."),
    as_json: bool = JSON_OPT,
) -> None:
    """Print a model directory's per-file SHA-256 listing, model hash and tokenizer hash."""
    from ..config.modelhash import hash_model_dir

    h = hash_model_dir(model_dir)
    if as_json:
        print_json({"model_sha256": h.model_sha256, "tokenizer_sha256": h.tokenizer_sha256, "files": h.files})
        return
    sys.stdout.write(h.listing() + f"model sha256:     {h.model_sha256}\ntokenizer sha256: {h.tokenizer_sha256}\n")
