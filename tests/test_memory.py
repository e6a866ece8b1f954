"""util.memory: the malloc settings a loaded engine applies (keep_freed_memory) do what they are for: freed memory
up to 32 MiB a block is reused rather than mapped fresh (counted in page faults, not timed)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

CHURN = """
import json, resource, sys
from kvgraft_cli.util.memory import keep_freed_memory
applied = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# A forward's pattern: several multi-MiB temporaries alive at once, then freed, op after op.
for _ in range(3):
    held = [bytearray(8 << 20) for _ in range(6)]
    del held
before = faults()
for _ in range(20):
    held = [bytearray(8 << 20) for _ in range(6)]
    del held
print(json.dumps({"applied": applied, "faults": faults() - before}))
"""


def _churn(keep: str) -> dict:
    import os

    out = subprocess.run(
        [sys.executable, "-c", CHURN],
        env={**os.environ, "KVGRAFT_KEEP_FREED": keep},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    """20 rounds of six 8 MiB blocks: glibc's defaults give most of them back and fault them in again every round
    (tens of thousands of faults); with the settings they are reused (a few hundred at most)."""
    kept, plain = _churn("1"), _churn("0")
    assert kept["applied"] and not plain["applied"]
    pages = 20 * 6 * (8 << 20) // 4096
    assert plain["faults"] > pages // 4, plain
    assert kept["faults"] < pages // 100, kept


def test_a_loaded_engine_applies_them(monkeypatch):
    from kvgraft_cli.engine import engine as eng

    called = []
    monkeypatch.setattr(eng, "keep_freed_memory", lambda: called.append(1) or True)
    from kvgraft_cli.config.manifest import load_manifest

    eng.load_engine(load_manifest(None))
    assert called == [1]
