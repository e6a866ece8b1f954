"""Tests that share a service (or a costly fixture) run on one xdist worker: the scheduler behind the README's
`--dist loadgroup`.

`--dist loadgroup` (the README's test command) is meant to send the tests of one `xdist_group` to one worker. Under
pytest 9.2 it silently does not: pytest-xdist 3.8 tags a grouped test by assigning `item._nodeid`, which pytest 9.2's
Node no longer reads (its nodeid comes from `_id`), so loadgroup behaves as plain load. The Ray and S3 tests then ran
on both workers at once: two `ray start` clusters overwriting one auth token, one worker's `ray stop` killing the
other's instance, a local `ray.init()` joining the other worker's cluster (the "Failed to connect to Ray cluster"
flake). This scheduler groups by module instead, from the table below, which the marks must match (checked at
a test, so a group mark added without its row fails instead of splitting silently).
"""

from __future__ import annotations

import pytest

SHARED_GROUPS = {
    "test_ray.py": "ray-s3",  # Ray instances and one SeaweedFS server; `ray` processes are machine-wide
    "test_s3.py": "ray-s3",
    "test_gguf.py": "smollm2",  # one worker converts the real GGUF once and runs the real model's tests
    "test_main_prereg.py": "smollm2",  # the main job's prereg replayed, on the worker that converted the GGUF
    "test_serve.py": "serve",  # the tiny model's library, deposited once, and the servers started on it
    "test_serve_bounded.py": "serve-bounded",  # servers on stores of their own: the bound, keys, tenants, metrics
    "test_batching.py": "batching",  # the tiny Llama GGUF's q4 manifest, written once, and the servers on it
    # Not services but costly fixtures, built once per worker that runs one of their tests (about 15-25 s each,
    # twice when their tests were spread over both workers):
    "test_report.py": "report",  # report_ledger: a CLI run of each kind the report shows
    "test_report_browser.py": "report",
    "test_cli_errors.py": "cli-errors",  # engine_runs: the model-loading commands, each in a folder of its own
    "test_replay.py": "replay",  # finished_run: a deposit, a graft check, a score and a prereg
    # tiny: the tiny GGUF's q4 and serve manifests, and the benchmarks' smoke runs, each a fresh process of a few
    # seconds (a minute in all: on one worker, not twice the GGUF's conversion and both workers' cores at once)
    "test_benchmarks.py": "benchmarks",
}


def shared_group(nodeid: str) -> str | None:
    """The SHARED_GROUPS group of a test's node id (``tests/test_ray.py::test_x[...]@group`` -> ``ray-s3``)."""
    return SHARED_GROUPS.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: xdist's load-scope scheduling with a scope per test, or per SHARED_GROUPS group."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedServiceScheduling(LoadScopeScheduling):
        # Scopes are sorted largest first, by test count (xdist's --loadscope-reorder default): the groups start
        # first, one on each worker, instead of leaving one worker alone with the 3-minute Ray group at the end.
        def _split_scope(self, nodeid: str) -> str:
            return shared_group(nodeid) or nodeid

    return SharedServiceScheduling(config, log)


def pytest_runtest_setup(item):
    """Every `xdist_group` mark names its module's SHARED_GROUPS group, and every grouped module carries the mark: a
    test whose mark and row differ fails (a failure in collection would reach xdist's controller as an unreadable
    internal error)."""
    marked = {m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")}
    want = shared_group(item.nodeid)
    if marked != ({want} if want else set()):
        pytest.fail(
            f"{item.nodeid}: xdist_group mark {sorted(marked)} but tests/xdist_groups.py SHARED_GROUPS says "
            f"{want!r}; keep the two in step",
            pytrace=False,
        )
