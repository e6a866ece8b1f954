"""The README's `-n 2 --dist loadgroup` keeps each SHARED_GROUPS group on one worker (tests/xdist_groups.py): a small
suite named like the grouped modules runs in a child pytest, each test writing down its worker. Red without the
scheduler (pytest 9.2 with pytest-xdist 3.8 spreads a group over both workers), and when a mark and the table differ."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

TESTS = Path(__file__).resolve().parent
GROUPED = """
import os, pathlib, time, pytest
pytestmark = pytest.mark.xdist_group("{group}")
@pytest.mark.parametrize("i", range(4))
def test_step(i):
    time.sleep(0.1)
    pathlib.Path("{out}", "{name}-" + str(i)).write_text(os.environ["PYTEST_XDIST_WORKER"])
"""
FILLER = """
import time, pytest
@pytest.mark.parametrize("i", range(12))
def test_filler(i):
    time.sleep(0.1)
"""


def _run(d: Path) -> subprocess.CompletedProcess:
    (d / "conftest.py").write_text("from xdist_groups import pytest_runtest_setup, pytest_xdist_make_scheduler\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", str(d)],
        cwd=d,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_group_runs_on_one_worker(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, group in (("test_ray", "ray-s3"), ("test_s3", "ray-s3"), ("test_gguf", "smollm2")):
        (suite / f"{name}.py").write_text(GROUPED.format(group=group, out=out, name=name))
    (suite / "test_filler.py").write_text(FILLER)
    p = _run(suite)
    assert p.returncode == 0, p.stdout + p.stderr
    workers = {f.name: f.read_text() for f in out.iterdir()}
    assert len(workers) == 12
    ray_s3 = {w for n, w in workers.items() if n.startswith(("test_ray-", "test_s3-"))}
    smollm2 = {w for n, w in workers.items() if n.startswith("test_gguf-")}
    assert len(ray_s3) == 1 and len(smollm2) == 1, workers
    assert ray_s3 != smollm2, workers  # the two groups, largest first, start one on each worker


def test_a_mark_the_table_does_not_know_stops_the_run(tmp_path):
    (tmp_path / "test_other.py").write_text(GROUPED.format(group="ray-s3", out=tmp_path, name="x"))
    p = _run(tmp_path)
    assert p.returncode != 0 and "keep the two in step" in p.stdout + p.stderr, p.stdout + p.stderr
