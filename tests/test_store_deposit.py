"""Deposit through the library: verification, idempotence, content addressing, ledger entries."""

from __future__ import annotations

from conftest import EXAMPLES, MATH500

from kvgraft_cli.config.manifest import load_manifest, with_overrides
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.runs.context import RunContext
from kvgraft_cli.runs.deposit import deposit
from kvgraft_cli.store.local import Store
from kvgraft_cli.util.hashing import sha256_bytes


def _objects(store):
    return sorted((store / "objects").rglob("*.kvg"))


def test_examples_deposit_verified_and_skip_others(deposited):
    ctx, report = deposited
    by_id = {r.id: r for r in report.results}
    assert by_id["wrong-1"].status == "skipped" and "wrong" in by_id["wrong-1"].reason
    assert by_id["noref-1"].status == "skipped" and "no reference" in by_id["noref-1"].reason
    assert by_id["frac-1"].status == "deposited"  # \frac{3}{4} vs \dfrac{3}{4}
    assert by_id["pow-1"].status == "deposited"  # 1{,}024 vs 1024
    assert by_id["angle-1"].status == "deposited"  # 70^\circ vs 70
    t = report.totals()
    assert (t["deposited"], t["skipped"]) == (7, 2)
    assert len(_objects(ctx.store)) == 7


def test_same_problem_twice_gives_same_artifact_and_no_second_object(ctx, engine):
    r1 = deposit(ctx, EXAMPLES, limit=3, engine=engine)
    r2 = deposit(ctx, EXAMPLES, limit=3, engine=engine)
    r3 = deposit(ctx, EXAMPLES, limit=3, engine=engine, recompute=True)  # prefill again: same bytes
    assert [r.artifact for r in r1.results] == [r.artifact for r in r2.results] == [r.artifact for r in r3.results]
    assert {r.status for r in r2.results} == {"existing"} == {r.status for r in r3.results}
    assert len(_objects(ctx.store)) == 3
    with Store(ctx.store) as s:
        assert s.stats()["objects"] == 3 and s.stats()["entries"] == 3


def test_ledger_entries_carry_input_and_output_hashes(deposited):
    ctx, report = deposited
    entries = [e for e in ledger.read(ctx.ledger) if e["kind"] == "deposit"]
    assert len(entries) == 7
    e = entries[0]
    assert set(e["inputs"]) == {"problems_file", "record", "token_ids", "settings"}
    assert set(e["outputs"]) == {"artifact", "logits"}
    assert e["manifest"]["sha256"] and e["manifest"]["compute_sha256"] and e["model"]["sha256"]
    # The recorded artifact path and hash check out against the file on disk.
    path = ctx.ledger.parent / e["outputs"]["artifact"]["path"]
    from kvgraft_cli.artifacts.format import read_file

    payload, art = read_file(path)
    assert sha256_bytes(payload) == e["outputs"]["artifact"]["sha256"]
    assert art.meta["logits_sha256"] == e["outputs"]["logits"]["sha256"]
    from kvgraft_cli.engine.engine import token_ids_sha256

    assert token_ids_sha256(art.token_ids) == e["inputs"]["token_ids"]["sha256"]


def test_unverified_deposit_needs_the_flag(ctx, engine):
    rep = deposit(ctx, EXAMPLES, engine=engine, allow_unverified=True)
    by_id = {r.id: r for r in rep.results}
    assert by_id["wrong-1"].status == "deposited" and not by_id["wrong-1"].verified
    assert by_id["sum-1"].verified
    with Store(ctx.store) as s:
        flags = {e.problem_id: e.verified for e in s.entries()}
    assert flags["wrong-1"] is False and flags["sum-1"] is True


def test_math500_deposits_with_field_mapping(tmp_path, engine):
    m = load_manifest(EXAMPLES.parents[1] / "manifests" / "math500.yaml")
    assert m.compute_sha256 == engine.manifest.compute_sha256  # input mapping is not part of the pin
    ctx = RunContext.make(m, tmp_path / "s", tmp_path / "l.jsonl")
    rep = deposit(ctx, MATH500, limit=5, engine=engine)
    assert [r.status for r in rep.results] == ["deposited"] * 5
    assert all(r.id.startswith("p-") for r in rep.results)
    # The same mapping given as overrides (what --field does) gives the same artifacts.
    m2 = with_overrides(
        load_manifest(None),
        {"input.id": None, "input.problem": "question", "input.solution": "answer", "input.answer_extract": "trailer"},
    )
    rep2 = deposit(RunContext.make(m2, tmp_path / "s2", tmp_path / "l2.jsonl"), MATH500, limit=5, engine=engine)
    assert [r.artifact for r in rep.results] == [r.artifact for r in rep2.results]


def test_store_resolves_ids_prefixes_and_latest(deposited):
    ctx, report = deposited
    art = {r.id: r.artifact for r in report.results if r.artifact}
    with Store(ctx.store) as s:
        assert s.resolve("lin-1") == art["lin-1"]
        assert s.resolve(art["lin-1"][:10]) == art["lin-1"]
        assert s.resolve(None) == art["gcd-1"]  # the last one deposited


def test_an_index_row_pointing_a_prefix_at_another_artifact_is_refused(ctx, engine):
    """The index is only a label: when a re-deposit finds its prefix already indexed, the stored artifact must hold
    exactly that prefix, or the ledger line would say these tokens made another artifact."""
    import sqlite3

    import pytest

    from kvgraft_cli.errors import IntegrityError

    first = deposit(ctx, EXAMPLES, engine=engine, limit=2)
    a, b = [r for r in first.results if r.artifact][:2]
    db = sqlite3.connect(ctx.store / "index.sqlite")
    with db:
        db.execute("UPDATE entries SET artifact = ? WHERE artifact = ?", (b.artifact, a.artifact))
    db.close()
    before = ctx.ledger.read_bytes()
    with pytest.raises(IntegrityError, match=f"index names artifact {b.artifact[:16]}"):
        deposit(ctx, EXAMPLES, engine=engine, limit=1)
    assert ctx.ledger.read_bytes() == before


def test_an_object_deleted_before_its_index_row_says_so_not_ray(ctx, engine, monkeypatch):
    """#24.12: `kvgraft store gc --grace 0` during a deposit deleted an object written but not yet indexed; the
    single-process deposit then failed naming `--ray-address`. The message says what happened and how to resume;
    nothing was recorded for that problem."""
    import pytest

    from kvgraft_cli.errors import StoreError
    from kvgraft_cli.runs import deposit as dep

    real = dep.compute_deposit

    def then_gc(m, engine, store, *args):  # what gc --grace 0 does between the object and its index row
        c = real(m, engine, store, *args)
        store.object_path(c.artifact).unlink()
        return c

    monkeypatch.setattr(dep, "compute_deposit", then_gc)
    with pytest.raises(StoreError) as e:
        deposit(ctx, EXAMPLES, limit=1, engine=engine)
    text = f"{e.value.message} {e.value.hint}"
    assert "--ray" not in text and "gc" in text and "deleted" in text and "re-run" in text, text
    assert not ctx.ledger.exists() or ctx.ledger.read_bytes() == b""


def test_gc_with_no_grace_during_a_deposit_deletes_nothing_it_wrote(ctx, engine, monkeypatch):
    """#24.12, the other half: gc skips objects younger than the oldest running deposit it can see (a registered
    writer holding its lock, store/writers.py), whatever --grace says; so `gc --grace 0` in the middle of a deposit
    leaves the deposit whole. Once no writer runs, the grace alone applies again."""
    from kvgraft_cli.runs import deposit as dep
    from kvgraft_cli.runs.gc import collect_garbage

    real, seen = dep.compute_deposit, []

    def with_gc(m, engine, store, *args):  # gc --grace 0 between the object and its index row
        c = real(m, engine, store, *args)
        seen.append(collect_garbage(ctx.store, [], grace_s=0))
        return c

    monkeypatch.setattr(dep, "compute_deposit", with_gc)
    report = deposit(ctx, EXAMPLES, limit=2, engine=engine)
    assert [r.status for r in report.results] == ["deposited", "deposited"]
    assert seen and all(not g.unindexed for g in seen), seen
    assert not list((ctx.store / "writers").iterdir())  # the registration is gone with the deposit
    orphan = ctx.store / "objects" / "ab" / ("ab" * 32 + ".kvg")
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"unindexed")
    assert collect_garbage(ctx.store, [], grace_s=0).unindexed == [str(orphan)] and not orphan.exists()
