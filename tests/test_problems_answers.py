"""Problem files and the answer extractor used for deposit verification."""

from __future__ import annotations

import json

import pytest
from conftest import MATH500

from kvgraft_cli.errors import ProblemFileError
from kvgraft_cli.eval import answers
from kvgraft_cli.eval.problems import read_problems, verify_solution

DEFAULT_MAP = {
    "id": "id",
    "problem": "problem",
    "solution": "solution",
    "answer": "answer",
    "answer_extract": "verbatim",
}
# Texts both extractor versions read the same way.
BOTH_VERSIONS = [
    ("so $\\boxed{42}$.", "42"),
    ("\\boxed{\\frac{1}{2}} then \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\fbox{7}", "7"),
    ("no box. The answer is: 12", "12"),
    ("work\nAnswer: x=3", "x=3"),
    ("nothing here", None),
    ("\\boxed{unclosed", None),
    ("Final Answer: 12\nThis is because...", "12"),
    ("Answer: 3\nWait, let me recheck.\nAnswer: 5", "5"),
    ("so \\boxed 7 is it", "7"),
    ("\\boxed{1} and later \\boxed 9", "9"),
]
MATH_MAP = {"id": None, "problem": "question", "solution": "answer", "answer": "answer", "answer_extract": "trailer"}


@pytest.mark.parametrize(
    "text,want",
    BOTH_VERSIONS
    + [
        ("The answer is 5.\n\nI hope this helps!", "5."),  # version 2 keeps the period
    ],
)
def test_extract_version_2_is_unchanged(text, want):
    """Version 2 stays callable, byte for byte, so verify recomputes version-2 scores exactly."""
    assert answers.extract(text, "2") == want


@pytest.mark.parametrize(
    "text,want",
    BOTH_VERSIONS
    + [
        # What version 2 found, version 3 finds too (without the trailing period).
        ("The answer is 5.\n\nI hope this helps!", "5"),
        # Styles version 2 missed (issue 11).
        ("**Answer:** 385", "385"),
        ("**Answer: 117**", "117"),
        ("Final Answer: The final answer is $33$. I hope it is correct.", "$33$"),
        ("so answer = 025", "025"),
        ("the answer is **468**", "468"),
        ("the answer is **468**.", "468"),
        ("**Final Answer**: 7", "7"),
        ("### Final Answer: 9", "9"),
        ("Final Answer:\n\n12", "12"),
        ("Therefore, the final answer is $\\boxed{5}$. I hope it is correct.", "5"),
        ("My answer is 8", "8"),
    ],
)
def test_extract(text, want):
    assert answers.extract(text) == want == answers.extract(text, "3")


@pytest.mark.parametrize(
    "text,right,wrong",
    [
        # An earlier wrong answer, then the final right one: the last statement wins, whatever its style.
        ("\\boxed{3}. Hmm, that is wrong; the answer is 5.", "5", "3"),
        ("Answer: 3\nNo wait.\n**Answer:** 5", "5", "3"),
        ("The answer is 3.\nActually \\boxed{5}", "5", "3"),
        ("answer = 3\nanswer = 5", "5", "3"),
        (
            "Final Answer: The final answer is $3$. I hope it is correct.\n"
            "Final Answer: The final answer is $5$. I hope it is correct.",
            "5",
            "3",
        ),
        ("**Answer: 3**\n\nLet me redo it.\n\nthe answer is **5**", "5", "3"),
    ],
)
def test_extract_takes_the_final_answer(text, right, wrong):
    got = answers.extract(text)
    assert answers.answers_match(got, right) and not answers.answers_match(got, wrong)


@pytest.mark.parametrize(
    "text,wrong",
    [
        # Never accepts a wrong answer: text that mentions the reference without stating it extracts something else.
        ("The answer is not 42.", "42"),
        ("the answer is 5, not 7", "7"),
        ("the answer is 5, not 7", "5"),
        ("the answer is **42**, not **43**", "42"),
        ("the answer is $5$ if x > 0 and $7$ otherwise", "5"),
        ("Answer: 12 or 13", "12"),
        ("so answer = 025 + 1", "25"),
        ("I computed 42 earlier, so the answer is 41", "42"),
        ("The answer is: \\frac{1}{2} or \\boxed{3}", "\\frac{1}{2}"),
        ("the answer is 42.5", "42"),
        ("x = 5\nanswer == 5", "5"),
    ],
)
def test_extract_never_accepts_a_wrong_answer(text, wrong):
    got = answers.extract(text)
    assert got is None or not answers.answers_match(got, wrong)


def test_aime_style_leading_zeros_are_the_same_integer():
    """Documented choice: "025" (AIME's three digits) equals 25; a decimal keeps its zero."""
    assert answers.answers_match(answers.extract("so answer = 025"), "25")
    assert answers.answers_match("025", "025") and not answers.answers_match("0.25", "25")


def test_unknown_extractor_version_is_refused():
    with pytest.raises(ValueError, match="extractor version '1'"):
        answers.extract("\\boxed{1}", "1")


def test_math500_version_3_extracts_what_version_2_did():
    """Real data: the new styles change nothing on MATH-500's own solutions (all 500 extractions identical)."""
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    assert [answers.extract(r["answer"]) for r in rows] == [answers.extract(r["answer"], "2") for r in rows]


@pytest.mark.parametrize(
    "a,b",
    [
        ("1{,}024", "1024"),
        ("1,000,000", "1000000"),
        ("007", "7"),
        ("\\dfrac{3}{4}", "\\frac{3}{4}"),
        ("70^\\circ", "70"),
        ("5.", "5"),
        ("\\text{(B)}", "(B)"),
        ("\\left(1, 2\\right)", "(1,2)"),
        ("$x$", "x"),
        ("$5$.", "5"),
        ("$\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("\u22125", "-5"),
        ("00", "0"),
    ],
)
def test_normalize_equal(a, b):
    assert answers.answers_match(a, b)


@pytest.mark.parametrize(
    "a,b",
    [
        ("81", "72"),
        ("1.5", "15"),
        ("\\frac{1}{2}", "\\frac{2}{1}"),
        ("-7", "7"),
        ("\\leftarrow", "\\rightarrow"),
        ("00", ""),
    ],
)
def test_normalize_different(a, b):
    assert not answers.answers_match(a, b)


def test_math500_boxed_agrees_with_trailer_on_every_record():
    """Real data: each solution's last \\boxed{} answer equals its own 'The answer is:' trailer."""
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    disagree = [
        i
        for i, r in enumerate(rows)
        if not answers.answers_match(answers.last_boxed(r["answer"]) or "", answers.trailer(r["answer"]) or "-")
    ]
    assert len(rows) == 500
    assert disagree == []


def test_math500_reads_with_mapping_and_verifies():
    probs = read_problems(MATH500, MATH_MAP)
    assert len(probs) == 500 and len({p.id for p in probs}) == 500
    assert all(verify_solution(p).status == "verified" for p in probs[:50])


def _jsonl(tmp_path, lines):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_bad_lines_are_named(tmp_path):
    good = json.dumps({"id": "a", "problem": "p", "solution": "s"})
    with pytest.raises(ProblemFileError, match=r"p.jsonl:2: malformed JSON"):
        read_problems(_jsonl(tmp_path, [good, "{not json"]), DEFAULT_MAP)
    with pytest.raises(ProblemFileError, match=r"p.jsonl:3: missing field 'solution'"):
        read_problems(_jsonl(tmp_path, [good, "", json.dumps({"id": "b", "problem": "p"})]), DEFAULT_MAP)
    with pytest.raises(ProblemFileError, match=r"p.jsonl:2: duplicate id 'a' \(first on line 1\)"):
        read_problems(_jsonl(tmp_path, [good, good]), DEFAULT_MAP)
    with pytest.raises(ProblemFileError, match=r"p.jsonl:1: expected a JSON object"):
        read_problems(_jsonl(tmp_path, ["[1, 2]"]), DEFAULT_MAP)
    with pytest.raises(ProblemFileError, match="must be a string"):
        read_problems(_jsonl(tmp_path, [json.dumps({"id": "a", "problem": 3, "solution": "s"})]), DEFAULT_MAP)


def test_verdicts(tmp_path):
    lines = [
        json.dumps(r)
        for r in (
            {"id": "ok", "problem": "p", "solution": "\\boxed{4}", "answer": "4"},
            {"id": "bad", "problem": "p", "solution": "\\boxed{5}", "answer": "4"},
            {"id": "none", "problem": "p", "solution": "\\boxed{5}"},
            {"id": "nobox", "problem": "p", "solution": "I think so.", "answer": 4},
        )
    ]
    got = {p.id: verify_solution(p).status for p in read_problems(_jsonl(tmp_path, lines), DEFAULT_MAP)}
    assert got == {"ok": "verified", "bad": "wrong", "none": "unverifiable", "nobox": "unverifiable"}
