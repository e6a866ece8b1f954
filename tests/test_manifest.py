"""Manifests: schema validation with paths and lines, strict YAML, compute pin, drift detection."""

from __future__ import annotations

import os

import pytest
import yaml

from kvgraft_cli.config import profiles
from kvgraft_cli.config.manifest import compute_pin, dump_yaml, load_manifest, make_manifest, validate_data
from kvgraft_cli.engine import determinism
from kvgraft_cli.errors import DriftError, ManifestError


def _write(tmp_path, data) -> str:
    p = tmp_path / "m.yaml"
    p.write_text(dump_yaml(data) if isinstance(data, dict) else data)
    return p


def test_default_manifest_is_valid_and_pins_the_embedded_model():
    m = load_manifest(None)
    assert m.model.path == "builtin:tiny-gemma4"
    assert (m.model_dir / "model.safetensors").is_file()
    from kvgraft_cli.config.modelhash import hash_model_dir

    assert hash_model_dir(m.model_dir).model_sha256 == m.model.sha256


def test_every_problem_is_reported_with_path_and_line(tmp_path):
    data = load_manifest(None).data
    data["runtime"]["colour"] = "blue"
    data["runtime"]["threads"] = "two"
    data["prompt"]["prefix"] = "{problem} {foo}"
    data["surplus"] = 1
    del data["decode"]
    p = _write(tmp_path, data)
    with pytest.raises(ManifestError) as e:
        load_manifest(p)
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 5, text
    for needle in (
        "runtime.colour: unknown key",
        "runtime.threads:",
        "prompt.prefix: unknown placeholder",
        "surplus: unknown key",
        "'decode' is a required property",
    ):
        assert needle in text
    # Lines point at the offending keys.
    lines = p.read_text().splitlines()
    colour = next(x for x in e.value.problems if "colour" in x)
    n = int(colour.split(":")[1])
    assert lines[n - 1].strip().startswith("colour:")


def test_duplicate_key_and_syntax_errors_name_the_line(tmp_path):
    text = "kvgraft_manifest: 1\nname: a\nname: b\n"
    with pytest.raises(ManifestError, match=r"m.yaml:3:.*duplicate key 'name' \(first on line 2\)"):
        load_manifest(_write(tmp_path, text))
    with pytest.raises(ManifestError, match=r"m.yaml:3:1: malformed YAML: .*flow sequence started on line 2"):
        load_manifest(_write(tmp_path, "model:\n  path: [unclosed\n"))


def test_compute_pin_ignores_paths_names_and_decode():
    a = load_manifest(None).data
    b = yaml.safe_load(dump_yaml(a))
    b["name"], b["paths"]["store"], b["decode"]["max_new_tokens"] = "x", "elsewhere", 3
    b["model"]["path"], b["input"]["problem"], b["prompt"]["query"] = "/m", "question", "{query}?"
    assert compute_pin(a) == compute_pin(b)
    for dotted, value in [
        ("runtime.threads", 2),
        ("model.dtype", "bfloat16"),
        ("prefill.schedule", "chunked"),
        ("runtime.env.MKL_CBWR", None),
        ("prompt.prefix", "{problem}"),
    ]:
        c = yaml.safe_load(dump_yaml(a))
        node = c
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
        assert compute_pin(c) != compute_pin(a), dotted


def test_generated_manifests_validate():
    for profile in profiles.PROFILES:
        data = make_manifest("some/model", "0" * 64, "1" * 64, profile=profile)
        assert validate_data(data, "generated") == []
        assert set(data["runtime"]["env"]) >= set(profiles.KNOWN_BIT_ENV)
    with pytest.raises(ManifestError, match="unknown profile"):
        make_manifest("m", "0" * 64, "1" * 64, profile="fastest")


@pytest.fixture
def saved_environ():
    """apply_environment writes os.environ itself: put it back exactly afterwards."""
    snapshot = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(snapshot)


def test_drift_in_unpinned_or_late_env_is_reported(saved_environ):
    rt = load_manifest(None).runtime
    os.environ["DNNL_MAX_CPU_ISA"] = "AVX2"
    drift = determinism.apply_environment({k: v for k, v in rt.env.items() if k != "DNNL_MAX_CPU_ISA"})
    assert any(d["field"] == "env.DNNL_MAX_CPU_ISA" for d in drift.items)
    # torch is imported in this process: changing a pinned variable now cannot take effect, and says so.
    import torch  # noqa: F401

    drift = determinism.apply_environment({**rt.env, "MKL_CBWR": "AVX2"})
    assert any(d["field"] == "env.MKL_CBWR" and "already imported" in d["effective"] for d in drift.items)
    with pytest.raises(DriftError, match="env.MKL_CBWR: pinned 'AVX2'") as e:
        drift.enforce(False, "m.yaml")
    assert "--allow-drift" in e.value.hint
    drift.enforce(True, "m.yaml")


def test_version_drift_is_detected():
    rt = load_manifest(None).runtime
    drift = determinism.Drift()
    determinism.configure_torch(
        rt.replace(versions={"torch": "2.0.0", "transformers": rt.versions["transformers"]}), drift
    )
    assert [d["field"] for d in drift.items] == ["runtime.versions.torch"]
    determinism.configure_torch(rt, determinism.Drift())  # restore the pinned flags for later tests


def test_cuda_manifest_refuses_clearly_without_a_gpu():
    import torch

    from kvgraft_cli.errors import DeviceError

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rt = load_manifest(None).runtime.replace(device="cuda", gpu_name="NVIDIA H200")
    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        determinism.configure_torch(rt, determinism.Drift())
    determinism.configure_torch(load_manifest(None).runtime, determinism.Drift())


def test_cli_choices_match_the_schema():
    """The choices the CLI offers (config.profiles) are exactly the values the manifest schema allows."""
    from kvgraft_cli.config.manifest import schema

    props = schema()["properties"]
    assert list(profiles.DEVICES) == props["runtime"]["properties"]["device"]["enum"]
    assert list(profiles.DTYPES) == props["model"]["properties"]["dtype"]["enum"]
    assert list(profiles.ATTN_IMPLEMENTATIONS) == props["model"]["properties"]["attn_implementation"]["enum"]
    assert list(profiles.WEIGHTS) == props["model"]["properties"]["weights"]["enum"]
    assert list(profiles.SDPA_BACKENDS) + [None] == props["runtime"]["properties"]["sdpa_backend"]["enum"]
