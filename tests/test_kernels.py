"""Kernel identities (config.kernels): what names the kernels that computed a run's bits, and what follows from it.

Under pinned kernels (portable, avx2) the manifest names them; under native the CPU does, and nothing computed
under another CPU's kernels is grafted (refused, naming both) or found (a miss in solve and serve). The second
machine is another CPU described in /proc/cpuinfo's format (KVGRAFT_CPUINFO): a Haswell desktop, which has the
instruction sets this machine's kernels use (so the process really computes, without drift) but is another CPU.
"""

from __future__ import annotations

import json

import pytest
from conftest import EXAMPLES, run_cli

from kvgraft_cli.config import kernels
from kvgraft_cli.config.profiles import PROFILES, profile_env
from kvgraft_cli.errors import DeviceError, KernelMismatch

HASWELL = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Core(TM) i7-4770 CPU @ 3.40GHz
flags		: fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand avx2 bmi1 bmi2

processor	: 1
vendor_id	: GenuineIntel
"""
SAPPHIRE_RAPIDS = """vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: sse4_1 sse4_2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
NEHALEM = """vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) CPU X5570
flags		: sse sse2 ssse3 sse4_1 sse4_2 popcnt
"""


def stand_in() -> tuple[str, str]:
    """Another CPU whose kernels this machine runs, for a test's second machine: (its /proc/cpuinfo text, its model
    name). The libraries read the real CPU, so the stand-in must dispatch as this one does (ATen's capability):
    a Haswell desktop on an AVX2 machine, a Sapphire Rapids Xeon on an AVX-512 one. Its model differs from this
    machine's, so its kernel identity does (the identity names the model)."""
    here = kernels.this_cpu()
    for text in (HASWELL, SAPPHIRE_RAPIDS):
        cpu = kernels.read_cpu(text)
        if cpu.aten_capability() == here.aten_capability() and cpu.model != here.model:
            return text, cpu.model
    pytest.skip(f"no stand-in CPU here dispatches as this one ({here.model}, {here.aten_capability()})")


def _env(profile: str) -> dict:
    return profile_env(profile)


def test_cpuinfo_is_read_and_capabilities_follow_atens_rule():
    hw, spr, old = (kernels.read_cpu(t) for t in (HASWELL, SAPPHIRE_RAPIDS, NEHALEM))
    assert hw.vendor == "GenuineIntel" and hw.model.startswith("Intel(R) Core(TM) i7-4770")
    assert hw.isa == ["sse4_1", "sse4_2", "avx", "f16c", "fma", "avx2"]
    assert (hw.aten_capability(), spr.aten_capability(), old.aten_capability()) == ("avx2", "avx512", "default")


def test_pinned_profiles_name_their_kernels_and_native_names_the_cpu():
    hw, spr = kernels.read_cpu(HASWELL), kernels.read_cpu(SAPPHIRE_RAPIDS)
    for profile in ("portable", "avx2"):
        assert kernels.left_to_machine(_env(profile)) == []
        assert kernels.kernel_identity(_env(profile), cpu=hw) is None
        assert kernels.machine_compute_sha256("ab" * 32, _env(profile), cpu=spr) == "ab" * 32
    native = _env("native")
    assert kernels.left_to_machine(native) == ["aten", "mkl", "onednn"]
    a, b = kernels.kernel_identity(native, cpu=hw), kernels.kernel_identity(native, cpu=spr)
    assert a and b and a != b and "i7-4770" in a and "amx_bf16" in b
    pins = {kernels.machine_compute_sha256("ab" * 32, native, cpu=cpu) for cpu in (hw, spr)}
    assert len(pins) == 2 and "ab" * 32 not in pins
    # one library left to the machine is enough to need a name
    partly = {**profile_env("avx2"), "MKL_CBWR": None}
    assert kernels.left_to_machine(partly) == ["mkl"] and kernels.kernel_identity(partly, cpu=hw)
    assert kernels.kernel_identity({}, "cuda", hw) is None  # gpu_name pins a GPU run


def test_the_avx2_profile_pins_every_library_and_needs_avx2():
    assert PROFILES["avx2"]["env"] == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    kernels.check_capability(_env("avx2"), cpu=kernels.read_cpu(HASWELL))
    kernels.check_capability(_env("portable"), cpu=kernels.read_cpu(NEHALEM))
    with pytest.raises(DeviceError, match="lacks fma, avx2|lacks avx2, fma"):
        kernels.check_capability(_env("avx2"), cpu=kernels.read_cpu(NEHALEM))


@pytest.fixture
def native_manifest(tmp_path):
    from kvgraft_cli.config.manifest import data_dir

    m = tmp_path / "native.yaml"
    run_cli(
        "manifest", "init", str(data_dir() / "tiny-gemma4"), "--profile", "native", "--threads", "1", "-o", str(m),
        cwd=tmp_path, check_rc=0,
    )  # fmt: skip
    return m


def test_native_artifacts_of_another_cpu_are_refused_and_missed(tmp_path, native_manifest):
    text, model = stand_in()
    other = tmp_path / "other.cpuinfo"
    other.write_text(text)
    there = {"KVGRAFT_CPUINFO": str(other)}
    m = ["-m", str(native_manifest)]
    dep = run_cli("deposit", str(EXAMPLES), "--limit", "1", *m, "--json", cwd=tmp_path, env=there, check_rc=0)
    sha = json.loads(dep.stdout)["results"][0]["artifact"]
    entry = json.loads((tmp_path / "kvgraft-ledger.jsonl").read_text().splitlines()[-1])
    assert model in entry["environment"]["kernels"]["identity"]
    assert (
        entry["environment"]["kernels"]["cpuinfo"] == str(other) and len(entry["environment"]["kernels"]["probe"]) == 64
    )

    # This machine's own CPU: refused, naming both machines' kernels and what to do (exit 2).
    refused = run_cli("graft", sha, *m, "--query", "2+2", cwd=tmp_path, check_rc=2)
    assert "computed on other kernels" in refused.stderr and model in refused.stderr
    assert "--profile avx2" in refused.stderr
    # ... and solve does not find it: this machine's library holds nothing of the other's, then only its own.
    first, second = (tmp_path / "first.jsonl"), (tmp_path / "second.jsonl")
    first.write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    second.write_text(EXAMPLES.read_text().splitlines()[1] + "\n")
    empty = run_cli("solve", str(first), *m, cwd=tmp_path, check_rc=2)
    assert "holds no verified solutions for this manifest's compute pin" in empty.stderr
    run_cli("deposit", str(second), *m, cwd=tmp_path, check_rc=0)
    run_cli("solve", str(first), *m, cwd=tmp_path, check_rc=0)
    lines = [json.loads(x) for x in (tmp_path / "kvgraft-ledger.jsonl").read_text().splitlines()]
    solve = [e for e in lines if e["kind"] == "solve"][-1]
    assert solve["inputs"]["library"]["hit"] != "exact"  # a miss: the other CPU's deposit of this very problem
    # The same CPU again grafts it.
    run_cli("graft", sha, *m, "--query", "2+2", cwd=tmp_path, env=there, check_rc=0)


def test_an_artifact_without_a_kernel_identity_is_refused_under_native(tmp_path, native_manifest):
    """An artifact deposited under native before identities were recorded carries the bare compute pin: its kernels
    are not known, so it is refused as computed on unrecorded kernels (red if check_compatible skips it)."""
    from kvgraft_cli.artifacts import format as fmt
    from kvgraft_cli.config.manifest import load_manifest

    m = load_manifest(native_manifest)
    want = {"model_sha256": "m", "kernels": m.kernels, "compute_pin_sha256": m.compute_sha256,
            "manifest_sha256": m.machine_compute_sha256}  # fmt: skip
    with pytest.raises(KernelMismatch, match="unrecorded kernels"):
        fmt.check_compatible({"model_sha256": "m", "manifest_sha256": m.compute_sha256}, want, "old.kvg")
    fmt.check_compatible({"model_sha256": "m", "manifest_sha256": m.machine_compute_sha256, "kernels": m.kernels},
                         want, "new.kvg")  # fmt: skip


def test_a_cpu_without_avx2_is_refused_before_torch_loads(tmp_path):
    """The avx2 profile on a CPU without AVX2 and FMA (a Nehalem Xeon, KVGRAFT_CPUINFO): one line naming what is
    missing and what to do, exit 2, nothing written. Without the check ATen would run its AVX2 kernels anyway: with
    ATEN_CPU_CAPABILITY=avx512 on an AVX2-only EPYC, torch reports AVX512 and its first softmax dies of SIGILL."""
    from kvgraft_cli.config.manifest import data_dir

    m = tmp_path / "avx2.yaml"
    run_cli(
        "manifest", "init", str(data_dir() / "tiny-gemma4"), "--profile", "avx2", "-o", str(m), cwd=tmp_path, check_rc=0
    )
    old = tmp_path / "nehalem.cpuinfo"
    old.write_text(NEHALEM)
    p = run_cli(
        "deposit",
        str(EXAMPLES),
        "--limit",
        "1",
        "-m",
        str(m),
        cwd=tmp_path,
        env={"KVGRAFT_CPUINFO": str(old)},
        check_rc=2,
    )
    assert (
        "pins ATEN_CPU_CAPABILITY=avx2" in p.stderr
        and "lacks avx2, fma" in p.stderr
        and "--profile portable" in p.stderr
    )
    assert not (tmp_path / "kvgraft-ledger.jsonl").exists() and not (tmp_path / "kvgraft-store").exists()
