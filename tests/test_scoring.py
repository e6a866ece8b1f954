"""`kvgraft score`: exact comparison after normalization, Wilson interval, order-independent records, and
`kvgraft verify` recomputing a recorded score."""

from __future__ import annotations

import json
import random

import pytest

from conftest import EXAMPLES, MATH500, run_cli
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.errors import ProblemFileError
from kvgraft_cli.eval.scoring import score, wilson_interval, write_records
from kvgraft_cli.audit.verify import verify_ledger

DEFAULT_MAP = {"id": "id", "problem": "problem", "solution": "solution", "answer": "answer", "answer_extract": "verbatim"}
MATH_MAP = {"id": None, "problem": "question", "solution": "answer", "answer": "answer", "answer_extract": "trailer"}


@pytest.mark.parametrize("k,n,lo,hi", [(3, 4, 0.3006, 0.9544), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0),
                                       (50, 100, 0.4038, 0.5962)])
def test_wilson_known_values(k, n, lo, hi):
    a, b = wilson_interval(k, n)
    assert (round(a, 4), round(b, 4)) == (lo, hi)


def test_wilson_edges_are_exact():
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(0, 10**6)[0] == 0.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_records_file_may_not_overwrite_an_input(tmp_path):
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}])
    before = out.read_bytes()
    p = run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--records", "outputs.jsonl", cwd=tmp_path,
                check_rc=2)
    assert "would be overwritten" in p.stderr and out.read_bytes() == before


def _outputs(tmp_path, rows, name="outputs.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_math500_solutions_score_500_of_500(tmp_path):
    """Real data: each solution's extracted answer agrees with its own trailer on all 500 problems."""
    from kvgraft_cli.eval.problems import read_problems

    probs = read_problems(MATH500, MATH_MAP)
    out = _outputs(tmp_path, [{"id": p.id, "output": p.solution} for p in probs])
    r = score(out, MATH500, MATH_MAP)
    assert (r.n, r.correct) == (500, 500)
    assert [x.id for x in r.records] == sorted(x.id for x in r.records)


def test_records_do_not_depend_on_output_order(tmp_path):
    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]
    outs = [{"id": r["id"], "output": r["solution"]} for r in rows if "answer" in r]
    a = score(_outputs(tmp_path, outs, "a.jsonl"), EXAMPLES, DEFAULT_MAP)
    random.Random(1).shuffle(outs)
    b = score(_outputs(tmp_path, outs, "b.jsonl"), EXAMPLES, DEFAULT_MAP)
    assert a.records_bytes() == b.records_bytes()
    assert a.summary()["correct"] == 7 and a.summary()["n"] == 8  # wrong-1 is wrong


def test_unknown_id_and_bad_lines(tmp_path):
    with pytest.raises(ProblemFileError, match=r"outputs.jsonl:1: id 'nope'"):
        score(_outputs(tmp_path, [{"id": "nope", "output": "\\boxed{1}"}]), EXAMPLES, DEFAULT_MAP)
    (tmp_path / "bad.jsonl").write_text('{"id": "sum-1", "output": "x"}\n{oops\n')
    with pytest.raises(ProblemFileError, match=r"bad.jsonl:2: malformed JSON"):
        score(tmp_path / "bad.jsonl", EXAMPLES, DEFAULT_MAP)


def test_cli_score_and_verify_recomputes(tmp_path):
    _outputs(tmp_path, [{"id": "sum-1", "output": "so \\boxed{42}"}, {"id": "lin-1", "output": "x = 6"},
                              {"id": "gcd-1", "output": "The answer is: 42"}])
    r = json.loads(run_cli("score", "outputs.jsonl", "--answers", str(EXAMPLES), "--json", cwd=tmp_path,
                           check_rc=0).stdout)
    assert (r["n"], r["correct"]) == (3, 2)
    assert (tmp_path / "outputs.scores.jsonl").is_file()
    v = verify_ledger(tmp_path / "kvgraft-ledger.jsonl")
    assert v.passed and v.scores_checked == 1
    run_cli("score", "outputs.jsonl", "--answers", "missing.jsonl", cwd=tmp_path, check_rc=2)


def test_verify_catches_a_misreported_score(tmp_path):
    """A score entry whose recorded number does not follow from its outputs fails verify, naming the line."""
    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}, {"id": "lin-1", "output": "\\boxed{4}"}])
    res = score(out, EXAMPLES, DEFAULT_MAP)
    rec_sha = write_records(tmp_path / "rec.jsonl", res)
    from kvgraft_cli.util.hashing import sha256_bytes

    def entry(result):
        return {"inputs": {"outputs": {"path": "outputs.jsonl", "sha256": sha256_bytes(out.read_bytes())},
                           "answers": {"path": str(EXAMPLES), "sha256": sha256_bytes(EXAMPLES.read_bytes())},
                           "settings": {"mapping": DEFAULT_MAP, "id_field": "id", "output_field": "output"}},
                "outputs": {"records": {"path": "rec.jsonl", "sha256": rec_sha}, "result": result}}

    led = tmp_path / "l.jsonl"
    ledger.append(led, "score", entry(res.summary()))
    inflated = dict(res.summary(), correct=2, accuracy="1.0")
    ledger.append(led, "score", entry(inflated))
    v = verify_ledger(led)
    assert not v.passed and v.scores_checked == 2
    assert [(f.line, f.check) for f in v.findings] == [(2, "score")]
    # A forged entry whose result is not an object is a finding, not a crash.
    ledger.append(led, "score", {**entry(res.summary()), "outputs": {"records": {"path": "rec.jsonl", "sha256": rec_sha},
                                                                     "result": "all correct"}})
    v = verify_ledger(led)
    assert [(f.line, f.check) for f in v.findings] == [(2, "score"), (3, "score")]
    lines = led.read_bytes().split(b"\n")
    led.write_bytes(b"\n".join(lines[:2]) + b"\n")
    # Without the inputs, the records file alone still recomputes the aggregate.
    out.unlink()
    v = verify_ledger(led)
    assert [(f.line, f.check) for f in v.findings] == [(2, "score")]


def test_scores_from_another_extractor_version_are_recomputed_from_records(tmp_path):
    """Old outputs are not re-extracted with a newer extractor (that would change the number); the records file
    holds each extraction, and the aggregate is recomputed from it."""
    from kvgraft_cli.util.hashing import sha256_bytes

    out = _outputs(tmp_path, [{"id": "sum-1", "output": "\\boxed{42}"}, {"id": "lin-1", "output": "x"}])
    res = score(out, EXAMPLES, DEFAULT_MAP)
    data = res.records_bytes().replace(b'"extractor_version":"2"', b'"extractor_version":"0"')
    (tmp_path / "rec.jsonl").write_bytes(data)

    def entry(result):
        return {"inputs": {"outputs": {"path": "outputs.jsonl", "sha256": sha256_bytes(out.read_bytes())},
                           "answers": {"path": str(EXAMPLES), "sha256": sha256_bytes(EXAMPLES.read_bytes())},
                           "settings": {"mapping": DEFAULT_MAP, "id_field": "id", "output_field": "output"}},
                "outputs": {"records": {"path": "rec.jsonl", "sha256": sha256_bytes(data)}, "result": result}}

    led = tmp_path / "l.jsonl"
    ledger.append(led, "score", entry(dict(res.summary(), extractor_version="0")))
    ledger.append(led, "score", entry(dict(res.summary(), extractor_version="0", correct=2)))
    v = verify_ledger(led)
    assert v.scores_checked == 2
    assert [(f.line, f.check) for f in v.findings] == [(2, "score")]
