"""A graft into another model, tokenizer, dtype, layer layout or compute pin is refused, naming what differs."""

from __future__ import annotations

import shutil

import pytest

from kvgraft_cli.config.manifest import Manifest, data_dir, dump_yaml, load_manifest
from kvgraft_cli.config.modelhash import hash_model_dir
from kvgraft_cli.engine.engine import load_engine
from kvgraft_cli.engine.tinymodel import write_tiny_model
from kvgraft_cli.errors import ModelMismatch, UnsupportedModel
from kvgraft_cli.runs.context import RunContext
from kvgraft_cli.runs.graft import graft_check


def _manifest_for(model_dir, tmp_path, **model_fields) -> Manifest:
    data = load_manifest(None).data
    h = hash_model_dir(model_dir)
    data["model"].update(
        path=str(model_dir), sha256=h.model_sha256, tokenizer_sha256=h.tokenizer_sha256, **model_fields
    )
    path = tmp_path / "m.yaml"
    path.write_text(dump_yaml(data))
    return load_manifest(path)


def test_graft_into_another_model_is_refused(deposited, tmp_path):
    ctx, _ = deposited
    other = write_tiny_model(tmp_path / "other", seed=7)  # same architecture, other weights
    m = _manifest_for(other, tmp_path)
    eng = load_engine(m)
    c = RunContext(m, ctx.store, tmp_path / "l.jsonl")
    with pytest.raises(ModelMismatch, match="another model"):
        graft_check(c, eng, "sum-1", samples=1, max_new_tokens=1)
    assert not (tmp_path / "l.jsonl").exists()  # nothing appended for a refused graft


def test_graft_with_another_tokenizer_is_refused(deposited, tmp_path):
    ctx, _ = deposited
    model = tmp_path / "tok"
    shutil.copytree(data_dir() / "tiny-gemma4", model)
    cfg = (
        (model / "tokenizer_config.json")
        .read_text()
        .replace('"model_max_length"', '"clean_up_tokenization_spaces": true, "model_max_length"')
    )
    (model / "tokenizer_config.json").write_text(cfg)
    m = _manifest_for(model, tmp_path)
    eng = load_engine(m)
    with pytest.raises(ModelMismatch, match="another model"):
        graft_check(RunContext(m, ctx.store, tmp_path / "l.jsonl"), eng, "sum-1", 1, 1)


def test_graft_in_another_dtype_is_refused(deposited, tmp_path):
    ctx, _ = deposited
    m = _manifest_for(data_dir() / "tiny-gemma4", tmp_path, dtype="bfloat16")
    eng = load_engine(m)
    with pytest.raises(ModelMismatch, match="compute pin|dtype"):
        graft_check(RunContext(m, ctx.store, tmp_path / "l.jsonl"), eng, "sum-1", 1, 1)


def test_check_compatible_names_each_field():
    from kvgraft_cli.artifacts.format import check_compatible

    base = {
        "model_sha256": "a" * 64,
        "tokenizer_sha256": "b" * 64,
        "dtype": "float32",
        "layer_types": '["full"]',
        "sliding_windows": "[null]",
        "manifest_sha256": "c" * 64,
        "start_position": "0",
    }
    check_compatible(base, dict(base), "x")
    for key, label in [
        ("dtype", "dtype"),
        ("layer_types", "layer layout"),
        ("sliding_windows", "sliding windows"),
        ("tokenizer_sha256", "tokenizer"),
        ("start_position", "start position"),
    ]:
        with pytest.raises(ModelMismatch, match=label):
            check_compatible({**base, key: "other"}, base, "x")


def test_unsupported_cache_layer_is_named(engine):
    """A cache layer of another kind (here a quantized-style subclass) is refused with its class name."""
    from transformers.cache_utils import DynamicLayer

    class OffloadedLayer(DynamicLayer):
        pass

    cache = engine.new_cache()
    cache.layers[1] = OffloadedLayer()
    with pytest.raises(UnsupportedModel, match="OffloadedLayer"):
        engine.capture(cache)
