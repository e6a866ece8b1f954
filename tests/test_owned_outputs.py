"""No output option overwrites a file kvgraft owns (issue #24, items 6, 7 and 9): the ledger, the store's index and
objects, the manifest, the problems file. `--force` overwrites an earlier outputs file, never one of those; a
refusal is one `Error:` line, exit 2, and every owned file is byte for byte what it was."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from conftest import EXAMPLES, run_cli


def _sums(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def site(deposited, tmp_path) -> Path:
    """A copy of the session's deposited store and ledger (a refusal that failed must not damage the fixture)."""
    c, _ = deposited
    shutil.copytree(c.store, tmp_path / "store")
    shutil.copy(c.ledger, tmp_path / "ledger.jsonl")
    shutil.copy(EXAMPLES, tmp_path / "problems.jsonl")
    return tmp_path


def _refused(site: Path, *args: str, match: str) -> None:
    before = _sums(site)
    r = run_cli(*args, "--ledger", "ledger.jsonl", cwd=site)
    assert r.returncode == 2, r
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "internal error" not in r.stderr, r.stderr
    assert match in r.stderr, r.stderr
    assert _sums(site) == before  # nothing owned was touched, nothing half-written


@pytest.mark.parametrize(
    "target, what",
    [("ledger.jsonl", "the ledger"), ("store/index.sqlite", "the store"), ("store/objects/x.kvgb", "the store")],
)
def test_store_export_never_overwrites_the_ledger_or_the_store(site, target, what):
    """#24.6: `store export -o kvgraft-ledger.jsonl` replaced the ledger with the bundle, exit 0."""
    _refused(site, "store", "export", "-o", target, "--store", "store", match=what)


def test_store_export_into_a_missing_folder_is_one_line(site):
    """#24.9: `store export -o no/such/dir/x.kvgb` ended in `internal error: FileNotFoundError`."""
    _refused(site, "store", "export", "-o", "no/such/dir/x.kvgb", "--store", "store", match="no/such/dir")


@pytest.mark.parametrize("target", ["ledger.jsonl", "store/index.sqlite", "problems.jsonl"])
def test_solve_force_never_overwrites_the_ledger_or_the_store(site, target):
    """#24.7: `solve --outputs kvgraft-ledger.jsonl --force` overwrote the ledger with the outputs."""
    _refused(
        site,
        "solve",
        "problems.jsonl",
        "--outputs",
        target,
        "--force",
        "--no-library",
        "--store",
        "store",
        match=target,
    )


def test_score_records_never_overwrite_the_ledger(site):
    (site / "out.jsonl").write_text('{"id": "gcd-1", "output": "6"}\n')
    _refused(site, "score", "out.jsonl", "--answers", "problems.jsonl", "--records", "ledger.jsonl", match="the ledger")


def test_checkpoint_output_never_overwrites_the_ledger(site):
    before = _sums(site)
    r = run_cli("ledger", "checkpoint", "ledger.jsonl", "-o", "ledger.jsonl", cwd=site)
    assert r.returncode == 2 and "the ledger" in r.stderr and _sums(site) == before, r


@pytest.fixture
def init_site(tmp_path) -> Path:
    """A folder with a model (a copy of the committed demo model), a ledger and a store where a written manifest's
    runs would keep them (config.manifest.DEFAULT_PATHS), and a file named as a GGUF."""
    from kvgraft_cli.config.manifest import DEFAULT_PATHS

    shutil.copytree(Path(__file__).resolve().parents[1] / "kvgraft_cli" / "data" / "demo-gemma4", tmp_path / "model")
    (tmp_path / DEFAULT_PATHS["ledger"]).write_text('{"seq": 0}\n')
    (tmp_path / DEFAULT_PATHS["store"]).mkdir()
    (tmp_path / DEFAULT_PATHS["store"] / "index.sqlite").write_bytes(b"index")
    (tmp_path / "m.gguf").write_bytes(b"GGUF, or so it says")
    return tmp_path


@pytest.mark.parametrize(
    "model, target, match",
    [
        ("model", "kvgraft-ledger.jsonl", "the ledger"),
        ("model", "kvgraft-store/index.sqlite", "the store"),
        ("model", "model/config.json", "inside the model folder"),
        ("m.gguf", "m.gguf", "the model m.gguf"),
    ],
)
def test_manifest_init_never_overwrites_what_a_run_keeps_or_the_model(init_site, model, target, match):
    """`manifest init -o kvgraft-ledger.jsonl --force` wrote a manifest over the ledger its own runs would append to
    (and `-o MODEL/config.json --force` over the model it pins)."""
    before = _sums(init_site)
    r = run_cli("manifest", "init", model, "-o", target, "--force", cwd=init_site)
    assert r.returncode == 2, r
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and match in r.stderr, r.stderr
    assert _sums(init_site) == before


def test_manifest_init_force_still_replaces_an_earlier_manifest(init_site):
    (init_site / "m.yaml").write_text("old\n")
    r = run_cli("manifest", "init", "model", "-o", "m.yaml", "--force", cwd=init_site)
    assert r.returncode == 0, r.stderr
    assert (init_site / "m.yaml").read_text().startswith("# kvgraft run-manifest")
