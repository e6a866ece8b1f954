"""A score entry is recomputed by the rules, extractor and grader it records, so recording older ones must not be a
way around the recomputation (issue #24, items 2 and 3). From the entry's own facts and the ledger's order, verify
refuses settings no kvgraft could have written: an older rules or version after a newer one in the same ledger,
or beside fields that came later; and it compares the recomputed aggregate member for member, grader_libs included.

Each forgery below is complete: records file, its hash and the aggregate agree with one another, one more answer
counted correct (or the unanswered problems dropped), as a forger of the last line would write them."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import EXAMPLES
from test_scoring import DEFAULT_MAP, _backdate, _entry, _outputs

from kvgraft_cli.audit.verify import verify_ledger
from kvgraft_cli.eval import scoring
from kvgraft_cli.eval.scoring import ScoreResult, ScoreSettings, score, write_records
from kvgraft_cli.ledger import log as ledger


def _forged(res: ScoreResult, settings: ScoreSettings, flip: bool = True) -> ScoreResult:
    """The same records under other settings, one incorrect answered problem made correct."""
    recs, done = [], not flip
    for r in res.records:
        r = dataclasses.replace(r, extractor_version=settings.extractor_version)
        if not done and r.answered and not r.correct:
            r, done = dataclasses.replace(r, correct=True), True
        recs.append(r)
    return ScoreResult(recs, res.problems, settings, res.no_reference, res.grader_libs)


def _ledger_with(tmp_path, *results: tuple[ScoreResult, dict], out=None):
    led = tmp_path / "l.jsonl"
    for i, (res, settings) in enumerate(results):
        rec = tmp_path / f"rec{i}.jsonl"
        ledger.append(led, "score", _entry(out, write_records(rec, res), res.summary(), settings, rec.name))
    return led


@pytest.fixture
def outs(tmp_path):
    return _outputs(
        tmp_path,
        [
            {"id": "sum-1", "output": "\\boxed{42}"},
            {"id": "lin-1", "output": "\\boxed{4}"},
            {"id": "frac-1", "output": "\\boxed{3/4}"},
        ],
    )


def _findings(led) -> list[tuple[int, str]]:
    v = verify_ledger(led, cache=False)
    return [(f.line, f.message) for f in v.findings if f.check in ("score", "score-settings")]


@pytest.mark.parametrize("version", ["1", "2"])
def test_rules_2_with_an_older_extractor_is_refused(tmp_path, outs, version):
    """#24.2: extractor_version "1" on the last line turned the full recomputation off and the forged records passed;
    score rules 2 shipped with extractor 3, so no kvgraft wrote rules 2 with an older one."""
    good = score(outs, EXAMPLES, DEFAULT_MAP)
    old = ScoreSettings("2", version)
    led = _ledger_with(tmp_path, (good, None), (_forged(good, old), old.to_settings()), out=outs)
    found = _findings(led)
    assert [n for n, _ in found] == [2] and f'extractor version "{version}"' in found[0][1], found


def test_math_verify_older_than_its_first_pin_is_refused(tmp_path, outs, monkeypatch):
    """#24.2: grader_version "0.8.0" turned the recomputation off (not installed here) and the records passed; no
    kvgraft pinned math-verify before 0.9.0."""
    monkeypatch.setattr(scoring, "math_verify_versions", lambda: None)
    good = score(outs, EXAMPLES, DEFAULT_MAP)
    old = dataclasses.replace(ScoreSettings.current(grader="math-verify"), grader_version="0.8.0")
    led = _ledger_with(tmp_path, (_forged(good, old), old.to_settings()), out=outs)
    found = _findings(led)
    assert [n for n, _ in found] == [1] and 'math-verify "0.8.0"' in found[0][1], found


def test_settings_and_result_naming_other_extractors_is_refused(tmp_path, outs):
    """#24.2: settings.extractor_version "9" (not here: not recomputable) with a result of extractor 3 passed from
    the records file; the two must be the same version."""
    good = score(outs, EXAMPLES, DEFAULT_MAP)
    settings = dict(ScoreSettings().to_settings(), extractor_version="9")
    led = _ledger_with(tmp_path, (good, settings), out=outs)
    found = _findings(led)
    assert [n for n, _ in found] == [1] and "extractor_version" in found[0][1] and '"9"' in found[0][1], found


def test_a_score_without_rules_today_or_after_rules_2_is_refused(tmp_path, outs):
    """#24.2: a score appended today without settings.rules was read as rules 1, which drops unanswered problems
    from the denominator (2 of 3 answered, instead of 2 of 8), and passed. Such an entry predates score rules 2:
    refused after an entry that records rules, or dated after rules 2 shipped, or beside fields that came later; an
    entry an older kvgraft wrote still recomputes."""
    rules1 = ScoreSettings.from_recorded({})
    old = score(outs, EXAMPLES, DEFAULT_MAP, settings=rules1)
    assert old.summary()["n"] == 3 and score(outs, EXAMPLES, DEFAULT_MAP).summary()["n"] == 8
    led = _ledger_with(tmp_path, (old, {}), out=outs)  # dated now
    found = _findings(led)
    assert [n for n, _ in found] == [1] and "score rules" in found[0][1] and "dated" in found[0][1], found
    _backdate(led, 1)
    assert _findings(led) == []  # as a kvgraft of rules 1 wrote it
    # After an entry that records rules, in the same ledger: dated before, still refused.
    led.unlink()
    led = _ledger_with(tmp_path, (score(outs, EXAMPLES, DEFAULT_MAP), None), (old, {}), out=outs)
    _backdate(led, 2)
    found = _findings(led)
    assert [n for n, _ in found] == [2] and "line 1" in found[0][1], found
    # Beside a field that came with rules 2.
    led.unlink()
    led = _ledger_with(tmp_path, (old, {"answered_only": False}), out=outs)
    _backdate(led, 1)
    found = _findings(led)
    assert [n for n, _ in found] == [1] and "answered_only" in found[0][1], found


def test_replay_of_an_old_run_records_its_rules(tmp_path, outs):
    """The one writer of rules 1 today, a replay of an old prereg, records rules and extractor explicitly: its entry
    is not mistaken for a downgrade, and reads back as the same settings."""
    rules1 = ScoreSettings.from_recorded({})
    assert rules1.to_settings() == {"rules": "1", "extractor_version": "2"}
    assert ScoreSettings.from_recorded(rules1.to_settings()) == rules1
    res = score(outs, EXAMPLES, DEFAULT_MAP, settings=rules1)
    led = _ledger_with(tmp_path, (score(outs, EXAMPLES, DEFAULT_MAP), None), (res, rules1.to_settings()), out=outs)
    v = verify_ledger(led, cache=False)
    assert v.passed and v.scores_checked == 2, v.first_problem()


def test_grader_libs_are_compared_member_for_member(tmp_path, outs, monkeypatch):
    """#24.3: the spec says the recomputed aggregate equals the recorded one member for member; verify skipped
    grader_libs, so editing the sympy version there passed."""
    libs = {
        "math-verify": scoring.MATH_VERIFY_PIN,
        "latex2sympy2_extended": "1.0.6",
        "antlr4-python3-runtime": "4.13.2",
        "sympy": "1.13.3",
    }
    monkeypatch.setattr(scoring, "math_verify_versions", lambda: dict(libs))
    monkeypatch.setattr(scoring, "_math_verify_equal", lambda a, b: a.replace(" ", "") == b.replace(" ", ""))
    mv = ScoreSettings.current(grader="math-verify")
    res = score(outs, EXAMPLES, DEFAULT_MAP, settings=mv)
    assert res.summary()["grader_libs"] == libs
    led = _ledger_with(tmp_path, (res, mv.to_settings()), out=outs)
    assert verify_ledger(led, cache=False).passed
    e = ledger.read(led)[0]
    edited = dict(e["outputs"]["result"], grader_libs=dict(libs, sympy="0.0"))
    ledger.append(led, "score", {"inputs": e["inputs"], "outputs": dict(e["outputs"], result=edited)})
    found = _findings(led)
    assert [n for n, _ in found] == [2] and "grader_libs" in found[0][1] and '"0.0"' in found[0][1], found
