"""Model hash: the sorted sha256sum listing, checkable with coreutils; pickled weights refused."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from kvgraft_cli.config.manifest import data_dir
from kvgraft_cli.config.modelhash import hash_model_dir
from kvgraft_cli.errors import InputError, UnsupportedModel


def test_model_hash_matches_coreutils(tmp_path):
    d = data_dir() / "tiny-gemma4"
    h = hash_model_dir(d)
    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum")
    names = sorted(h.files)
    listing = subprocess.run(["sha256sum", *names], cwd=d, capture_output=True, check=True, env={"LC_ALL": "C"}).stdout
    assert listing.decode() == h.listing()
    whole = subprocess.run(["sha256sum"], input=listing, capture_output=True, check=True).stdout.split()[0]
    assert whole.decode() == h.model_sha256
    assert set(names) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_any_changed_byte_changes_the_hash(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(data_dir() / "tiny-gemma4", d)
    h0 = hash_model_dir(d)
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text() + " ")
    h1 = hash_model_dir(d)
    assert h1.model_sha256 != h0.model_sha256 and h1.tokenizer_sha256 == h0.tokenizer_sha256
    (d / "notes.txt").write_text("not part of the model")  # unrelated files do not count
    assert hash_model_dir(d).model_sha256 == h1.model_sha256


def test_pickled_or_missing_weights_are_refused(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UnsupportedModel, match="pickled"):
        hash_model_dir(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(InputError, match="no \\*.safetensors"):
        hash_model_dir(d)
    with pytest.raises(InputError, match="not found"):
        hash_model_dir(tmp_path / "nope")
