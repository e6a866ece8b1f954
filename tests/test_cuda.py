"""The CUDA path for real, as a user runs it (CLI in fresh processes). Skipped without a GPU; scripts/gpu_check.sh
runs this file on a lent GPU machine. The no-GPU refusal is tested in test_refusals.py."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import EXAMPLES, run_cli


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU visible to torch")


def _cuda_manifest(tmp_path, dtype="float32", attn="eager"):
    from kvgraft_cli.config.manifest import data_dir

    path = tmp_path / f"cuda-{dtype}-{attn}.yaml"
    run_cli(
        "manifest",
        "init",
        str(data_dir() / "tiny-gemma4"),
        "--device",
        "cuda",
        "--profile",
        "native",
        "--dtype",
        dtype,
        "--attn",
        attn,
        "-o",
        str(path),
        cwd=tmp_path,
        check_rc=0,
    )
    return path


@pytest.mark.parametrize("dtype,attn", [("float32", "eager"), ("bfloat16", "eager"), ("float16", "sdpa")])
def test_deposit_and_graft_check_on_cuda(tmp_path, dtype, attn):
    import torch

    m = _cuda_manifest(tmp_path, dtype, attn)
    data = yaml.safe_load(m.read_text())
    assert data["runtime"]["gpu_name"] == torch.cuda.get_device_name(0)
    assert data["runtime"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    run_cli("deposit", str(EXAMPLES), "-m", str(m), cwd=tmp_path, check_rc=0)
    p = run_cli("graft", "--check", "--samples", "20", "-m", str(m), "--json", cwd=tmp_path, check_rc=0)
    report = json.loads(p.stdout)
    assert report["passed"] and report["sha_equal"] == 20 and report["max_kl"] == 0.0
    entries = [json.loads(line) for line in (tmp_path / "kvgraft-ledger.jsonl").read_text().splitlines()]
    env = entries[-1]["environment"]
    assert env["device"] == "cuda:0" and env["gpu"] == torch.cuda.get_device_name(0)
    assert env["deterministic_algorithms"] is True and env["allow_tf32"] is False
    assert env["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    run_cli("verify", cwd=tmp_path, check_rc=0)


def test_other_gpu_name_is_drift(tmp_path):
    m = _cuda_manifest(tmp_path)
    m.write_text(m.read_text().replace("gpu_name: NVIDIA", "gpu_name: Imaginary NVIDIA"))
    p = run_cli("deposit", str(EXAMPLES), "-m", str(m), cwd=tmp_path, check_rc=2)
    assert "runtime.gpu_name" in p.stderr and not (tmp_path / "kvgraft-ledger.jsonl").exists()


def test_matrix_on_cuda(tmp_path):
    p = run_cli(
        "matrix",
        "--device",
        "cuda",
        "--arch",
        "llama",
        "--arch",
        "gemma2",
        "--arch",
        "gpt2",
        "--samples",
        "5",
        "--json",
        cwd=tmp_path,
        check_rc=0,
    )
    cells = json.loads(p.stdout)["cells"]
    assert len(cells) == 9 and all(c["exact"] for c in cells), cells


@pytest.mark.parametrize("scheme", ["sha256", "sha256-tree"])
def test_device_restore_on_cuda_is_byte_identical_to_open_file(tmp_path, scheme):
    """artifacts.device_restore for real: pinned staging, async copies on a side stream, the hash overlapping them
    (tests/test_device_restore.py runs the same pipeline on the CPU). In-process: no CLI path uses it yet."""
    import torch
    from test_device_restore import _bytes, _payload, _raw

    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.artifacts.device_restore import open_file_on_device
    from kvgraft_cli.errors import IntegrityError

    for dtype in (torch.float32, torch.bfloat16):
        path, ident = _raw(tmp_path, _payload(dtype, scheme))
        _, want = kvg.open_file(path)
        deterministic = torch.are_deterministic_algorithms_enabled()
        for kw in ({}, {"chunk_bytes": 1 << 20, "ring": 2}, {"deterministic": True}):
            # Deterministic algorithms make torch.empty fill the destination on the current stream: the copies on
            # the side stream must land after that fill, not under it.
            torch.use_deterministic_algorithms(kw.pop("deterministic", deterministic))
            try:
                got_ident, art = open_file_on_device(path, "cuda", ident, **kw)
            finally:
                torch.use_deterministic_algorithms(deterministic)
            assert got_ident == ident and art.token_ids == want.token_ids and art.meta == want.meta
            for a, b in zip(art.layers, want.layers):
                for x, y in ((a.keys, b.keys), (a.values, b.values)):
                    assert x.device.type == "cuda" and x.dtype == y.dtype and x.shape == y.shape
                    assert torch.equal(x, y.to("cuda")) and torch.equal(_bytes(x), _bytes(y).to("cuda"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not match its identity"):
        open_file_on_device(path, "cuda", ident, chunk_bytes=1 << 20, ring=2)
