"""`kvgraft solve`: hits, misses, chains, the baseline, --deposit-verified, bad input and the ledger entries.

The embedded random model cannot read its context, so these tests check the mechanism (what is found, grafted,
counted, recorded and deposited), never accuracy."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import EXAMPLES, deposit_here, run_cli

from kvgraft_cli.audit.verify import verify_ledger
from kvgraft_cli.config.manifest import with_overrides
from kvgraft_cli.errors import InputError
from kvgraft_cli.eval import answers
from kvgraft_cli.eval.scoring import score
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.library.solve import answer_text, own_solution, solve
from kvgraft_cli.runs.context import RunContext
from kvgraft_cli.store.local import Store


@pytest.fixture
def lib_ctx(tmp_path, deposited, engine):
    """A writable copy of the session store (7 verified examples in its library), an empty ledger, and a
    manifest with a short answer budget and a stop string."""
    ctx, _ = deposited
    shutil.copytree(ctx.store, tmp_path / "store")
    m = with_overrides(engine.manifest, {"decode.answer_tokens": 3, "decode.stop": ["\n"]})
    return RunContext.make(m, tmp_path / "store", tmp_path / "ledger.jsonl")


def _entries(ctx, kind):
    return [e for e in ledger.read(ctx.ledger) if e["kind"] == kind]


def test_hits_budgets_and_ledger(lib_ctx, engine, tmp_path):
    run = solve(lib_ctx, EXAMPLES, tmp_path / "out.jsonl", k=2, engine=engine)
    by = {r.id: r for r in run.records}
    verified = ["sum-1", "frac-1", "lin-1", "area-1", "pow-1", "angle-1", "gcd-1"]
    assert all(by[i].hit == "exact" and len(by[i].chain) == 1 for i in verified)
    assert all(by[i].budget == 3 and by[i].decode_tokens <= 3 for i in verified)  # decode.answer_tokens
    # Not in the library (a wrong solution was never deposited; one has no reference): related, as a chain of 2.
    for i in ("wrong-1", "noref-1"):
        assert by[i].hit == "related" and len(by[i].chain) == 2 and by[i].budget == 16
        assert by[i].grafted_tokens + by[i].prefill_tokens > by[i].grafted_tokens
    assert all(r.grafted_tokens > 0 for r in run.records)
    assert by["sum-1"].prefill_tokens == len(
        engine.encode(
            lib_ctx.manifest.prompt.query.format(query=json.loads(EXAMPLES.read_text().splitlines()[0])["problem"])
        )
    )  # the query alone
    solves = _entries(lib_ctx, "solve")
    assert [e["inputs"]["record"]["id"] for e in solves] == [r.id for r in run.records]
    assert solves[0]["inputs"]["library"]["hit"] == "exact"
    assert (
        solves[0]["outputs"]["output"]["sha256"]
        == __import__("hashlib").sha256(by["sum-1"].output.encode()).hexdigest()
    )
    (summary,) = _entries(lib_ctx, "solve-outputs")
    assert summary["outputs"]["outputs"]["sha256"] == run.outputs_sha256
    report = verify_ledger(lib_ctx.ledger)
    assert report.passed and not report.missing, report.first_problem()
    # The outputs file is what `kvgraft score` reads, as it is.
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == [r.id for r in run.records]
    scored = tmp_path / "scored.jsonl"
    scored.write_text("".join(json.dumps(x) + "\n" for x in lines if x["id"] != "noref-1"))
    result = score(scored, EXAMPLES, lib_ctx.manifest.input.as_written())
    assert result.n == 8


def test_recurring_related_chain_is_free_the_second_time(lib_ctx, engine, tmp_path):
    first = solve(lib_ctx, EXAMPLES, tmp_path / "a.jsonl", k=3, engine=engine)
    again = solve(lib_ctx, EXAMPLES, tmp_path / "b.jsonl", k=3, engine=engine)
    a, b = first.records[-2], again.records[-2]  # wrong-1: related, 3 solutions chained
    assert a.hit == b.hit == "related" and len(a.chain) == 3 and a.chain == b.chain
    query = b.prefill_tokens
    assert a.prefill_tokens > query and b.grafted_tokens == a.grafted_tokens + a.prefill_tokens - query
    assert _entries(lib_ctx, "solve")[-2]["inputs"]["library"]["new_links"] == []  # wrong-1, second run
    # The outputs file holds only what the model and the library decide: the same bytes both times.
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_baseline_grafts_nothing(lib_ctx, engine, tmp_path):
    run = solve(lib_ctx, EXAMPLES, tmp_path / "base.jsonl", use_library=False, engine=engine)
    assert {r.hit for r in run.records} == {"none"}
    assert all(r.grafted_tokens == 0 and r.chain == [] and r.budget == 16 for r in run.records)
    assert _entries(lib_ctx, "solve-outputs")[0]["mode"] == "baseline"


def test_min_score_filters_related(lib_ctx, engine, tmp_path):
    run = solve(lib_ctx, EXAMPLES, tmp_path / "o.jsonl", k=2, min_score=1e9, engine=engine)
    assert {r.id: r.hit for r in run.records}["wrong-1"] == "none"


def test_deposit_verified_grows_the_library(lib_ctx, engine, tmp_path):
    """Only answers that match the reference are deposited; the same problem is an exact hit next time. The random
    model's own (deterministic) baseline answers serve as references, so some are right by construction."""
    # New problem texts (not in the library); first learn what the model answers to each with nothing grafted.
    problems = tmp_path / "mine.jsonl"
    texts = [f"Again: {json.loads(line)['problem']}" for line in EXAMPLES.read_text().splitlines()[:4]]
    problems.write_text(
        "".join(json.dumps({"id": f"new-{i}", "problem": t, "answer": "?"}) + "\n" for i, t in enumerate(texts))
    )
    probe = solve(lib_ctx, problems, tmp_path / "probe.jsonl", use_library=False, engine=engine)
    recs = [
        {"id": f"new-{i}", "problem": t, "answer": r.extracted if i % 2 == 0 else "a reference the model never writes"}
        for i, (t, r) in enumerate(zip(texts, probe.records))
    ]
    problems = tmp_path / "mine-with-references.jsonl"  # a new file: the probe's ledger entries name the first
    problems.write_text("".join(json.dumps(x) + "\n" for x in recs))
    with Store(lib_ctx.store) as s:
        before = s.library_size()
    # The same baseline answers again (nothing grafted, same texts): the even ones now match; deposit those.
    run = solve(lib_ctx, problems, tmp_path / "grow.jsonl", use_library=False, deposit_verified=True, engine=engine)
    right = [r for r in run.records if r.correct]
    wrong = [r for r in run.records if r.correct is False]
    assert wrong and all(r.deposited is None for r in wrong)  # never deposit an unverified answer
    assert all(r.deposited is not None for r in right)
    with Store(lib_ctx.store) as s:
        assert s.library_size() == before + len(right)
    deposits = [e for e in _entries(lib_ctx, "deposit") if e["inputs"]["settings"].get("from")]
    assert len(deposits) == len(right) and all(e["verification"]["status"] == "verified" for e in deposits)
    assert right  # the references built from the model's own answers make some right by construction
    again = {r.id: r for r in solve(lib_ctx, problems, tmp_path / "again.jsonl", engine=engine).records}
    assert all(again[r.id].hit == "exact" for r in right)
    assert all(again[r.id].hit != "exact" for r in wrong)
    assert verify_ledger(lib_ctx.ledger).passed


def test_answer_text_and_own_solution():
    assert answer_text(" 42\n") == "Answer: 42"
    assert answer_text("so \\boxed{7}") == "so \\boxed{7}"
    assert answers.extract(answer_text(" x^2+1")) == "x^2+1"
    assert own_solution("Answer: 42", "42") == "The answer is: 42"
    assert own_solution("We add. The answer is: 42", "42") == "We add. The answer is: 42"
    assert own_solution("Answer: \\boxed{3}", "3").endswith("The answer is: 3")


def test_refusals_write_nothing(lib_ctx, engine, tmp_path):
    empty = RunContext.make(lib_ctx.manifest, tmp_path / "no-store", tmp_path / "l2.jsonl")
    with pytest.raises(InputError, match="no store"):
        solve(empty, EXAMPLES, tmp_path / "x.jsonl", engine=engine)
    (tmp_path / "exists.jsonl").write_text("keep me\n")
    with pytest.raises(InputError, match="exists"):
        solve(lib_ctx, EXAMPLES, tmp_path / "exists.jsonl", engine=engine)
    assert (tmp_path / "exists.jsonl").read_text() == "keep me\n"
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"id": "ok", "problem": "short", "answer": "1"})
        + "\n"
        + json.dumps({"id": "huge", "problem": "x" * 40000, "answer": "1"})
        + "\n"
    )
    with pytest.raises(InputError, match=r"long.jsonl:2.*huge.*positions"):
        solve(lib_ctx, long, tmp_path / "y.jsonl", engine=engine)
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "y.jsonl").exists()
    assert not lib_ctx.ledger.exists() and not empty.ledger.exists()
    with pytest.raises(InputError, match="--k"):
        solve(lib_ctx, EXAMPLES, tmp_path / "z.jsonl", k=0, engine=engine)


def test_cli_compare_verify_and_stats(tmp_path, engine):
    deposit_here(engine, tmp_path, str(EXAMPLES))
    p = run_cli("solve", str(EXAMPLES), "--compare", "--k", "2", "--json", cwd=tmp_path, check_rc=0)
    out = json.loads(p.stdout)
    assert set(out) == {"baseline", "library", "ratios"}
    assert out["library"]["totals"]["exact_hits"] == 7 and out["baseline"]["totals"]["exact_hits"] == 0
    assert (tmp_path / "problems.solve.jsonl").is_file() and (tmp_path / "problems.baseline.jsonl").is_file()
    assert set(out["ratios"]) == {"decode_tokens", "prefill_tokens", "wall_s", "cpu_s", "energy_j"}
    run_cli("verify", "--require-files", cwd=tmp_path, check_rc=0)
    again = run_cli("solve", str(EXAMPLES), cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.startswith("Error: outputs file problems.solve.jsonl exists")
    human = run_cli("solve", str(EXAMPLES), "--compare", "--force", "--k", "3", cwd=tmp_path, check_rc=0)
    assert "decode tokens with the library instead of" in human.stdout and "ratio" in human.stdout
    # --force overwrote files that earlier entries name: verify says so (the files differ from their record).
    broken = run_cli("verify", cwd=tmp_path)
    assert broken.returncode == 1 and "problems." in broken.stderr and "does not match" in broken.stderr
    st = json.loads(run_cli("store", "stats", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert st["library_entries"] == 7 and st["verified_entries"] >= 7 and st["context_window"] == 32768
    assert st["tokens_per_window"] == st["tokens"] / 32768
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = run_cli("solve", str(EXAMPLES), cwd=empty)
    assert bad.returncode == 2 and "no store" in bad.stderr and not any(empty.iterdir())


def test_prereg_and_replay_of_a_solve_protocol(tmp_path, engine):
    """The protocol a user runs on their own model: deposit a library, solve with and without it, score both;
    `prereg make` turns the run into a prereg that replays, hash for hash, into a fresh store and ledger."""
    probs = tmp_path / "probs.jsonl"
    probs.write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines() if "noref" not in line))
    deposit_here(engine, tmp_path, "probs.jsonl")
    run_cli("solve", "probs.jsonl", "--compare", "--k", "2", "-o", "out.jsonl", cwd=tmp_path, check_rc=0)
    for mode in ("library", "baseline"):
        run_cli("score", f"out.{mode}.jsonl", "--answers", "probs.jsonl", cwd=tmp_path, check_rc=0)
    run_cli("prereg", "make", "--target", "cpu-portable", "-o", "prereg.yaml", cwd=tmp_path, check_rc=0)
    text = (tmp_path / "prereg.yaml").read_text()
    assert "kind: solve" in text and "output sum-1" in text and "hit sum-1: exact" in text
    fresh = ["--store", "fresh-store", "--ledger", "fresh.jsonl"]
    run_cli("replay", "--register", "prereg.yaml", *fresh, cwd=tmp_path, check_rc=0)
    p = run_cli("replay", "prereg.yaml", *fresh, "--json", cwd=tmp_path, check_rc=0)
    rep = json.loads(p.stdout)
    assert rep["passed"] and rep["mismatched"] == 0
    whats = {c["what"] for c in rep["comparisons"]}
    assert {"outputs_sha256", "output sum-1", "hit gcd-1", "records"} <= whats
    run_cli("verify", "fresh.jsonl", cwd=tmp_path, check_rc=0)


def test_greedy_stops_where_the_stop_string_first_appears(engine):
    """The stop check reads only the output's tail: it must stop exactly where the whole output first contains the
    stop string, here a two-token string 25+ tokens into the output."""
    ids = engine.prefix_ids("Problem: 1+1\nSolution:")
    cache, last = engine.prefill(ids)
    free, _ = engine.greedy(cache, last, 60)
    text_of = lambda toks: engine.decode_text(toks)  # noqa: E731
    i = next(
        i
        for i in range(25, 59)
        if (s := text_of(free[i - 1 : i + 1])) and "\ufffd" not in s and s not in text_of(free[:i])
    )
    stop = text_of(free[i - 1 : i + 1])
    cache, last = engine.prefill(ids)
    got, _ = engine.greedy(cache, last, 60, stop=[stop])
    assert got == free[: i + 1] and stop in text_of(got) and stop not in text_of(got[:-1])
