"""Final-answer extraction and normalization for math solutions.

Used by deposit to verify a solution against its reference answer, by solve, and by ``kvgraft score``. Every score
records the extractor version it used, and ``kvgraft verify`` re-runs that version, so a version, once released, is
never changed: a new rule is a new version, and the old ones stay callable through ``extract(text, version)``.

Version 3 (current): the final answer is the *last* final-answer statement in the text, by position, where a
statement is any of

- ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces balanced) or ``\\boxed 5``;
- "answer is" (any case, optionally "the"/"final" before it): "The answer is: X", "the answer is **468**",
  "The final answer is $33$"; the rest of the line;
- an answer label at the start of a line, with Markdown decoration: "Answer: X", "Final Answer: X",
  "**Answer:** 385", "**Answer: 117**", "### Final Answer: X"; the rest of the line (the next non-empty line
  when the label ends its line);
- an assignment "answer = X" ("so answer = 025"); the rest of the line.

A later statement overrides an earlier one ("Answer: 3 ... wait ... \\boxed{5}" gives 5, and so does
"\\boxed{3} ... the answer is 5"), because a solution that revises itself means its last word. The text taken is
cleaned of presentation only: the Minerva / lm-evaluation-harness tail "I hope it is correct.", trailing ``.``,
``,``, ``;`` or ``!``, and Markdown bold around the whole answer (``**468**``, or the ``**`` that closes a bolded
"**Answer: 117**" line). Nothing is cut out of the middle of the text: "the answer is 5, not 7" extracts
"5, not 7", which matches neither 5 nor 7 (never a wrong answer accepted; an unclear output is scored incorrect).

Choices where styles are ambiguous, compared with lm-evaluation-harness:

- ``minerva_math`` reads only "Final Answer: The final answer is X. I hope it is correct." and takes the *first*
  such line (``re.search``); here it is one statement among the others and the *last* statement wins (a model that
  writes the line twice meant the second).
- ``hendrycks_math`` takes the last ``\\boxed{}``, else the first ``\\[...\\]`` display, else the text between the
  first and the last ``$`` of the whole output. Here display math and bare dollar spans are never answers by
  themselves: an output without a statement above has no answer (scored incorrect), because "between the first
  and last $" accepts intermediate results.
- Both normalize by deleting unit words, "an "/"a " and everything before the last "=" (minerva). Here
  normalization removes presentation only; "x = 5" does not equal "5" (the reference may be an equation).
- AIME-style integers: "answer = 025" extracts "025", and normalization strips leading zeros from integers, so it
  equals a reference "25" (and "025"); the three-digit form is a presentation of the same integer. A leading zero
  is kept in decimals ("0.25" is not "25").

Version 2 (kept for recomputing version-2 scores): the last ``\\boxed{...}`` anywhere, else the rest of the line
after the last case-sensitive "The answer is", else the last line starting "Answer:" / "Final Answer:". Version 1
is not in this kvgraft (scores that used it are recomputed from their records file when it is present).

Normalization (all versions) removes presentation only (spaces, ``\\left``/``\\right``, ``\\text{}``,
``\\dfrac``, thousands separators, a trailing period, degree signs, ``$``), then answers are compared exactly.
"""

from __future__ import annotations

import re

EXTRACTOR_VERSION = "3"
EXTRACTOR_VERSIONS = ("2", "3")  # the versions extract() can run (verify re-runs the recorded one)

_TRAILER = re.compile(r"The answer is:?[ \t]*(.+?)[ \t]*$", re.M)  # the rest of that line
_ANSWER = re.compile(r"^[ \t]*(?:Final )?Answer:[ \t]*(.+?)[ \t]*$", re.M | re.I)
_BARE_BOXED = re.compile(r"\\boxed[ \t]+([^\s$]+)")  # \boxed 5 (no braces)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces balanced), or None."""
    best: tuple[int, str] | None = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\" and i + 1 < len(text):
                i += 2  # skip escaped characters such as \{ and \}
                continue
            depth += c == "{"
            depth -= c == "}"
            i += 1
        if depth == 0:
            best = (m.start(), text[m.end() : i - 1])
    bare = None
    for bare in _BARE_BOXED.finditer(text):  # noqa: B007  (keeps the last match)
        pass
    if bare is not None and (best is None or bare.start() > best[0]):
        return bare.group(1)
    return best[1] if best else None


def trailer(text: str) -> str | None:
    """The text after the last "The answer is:" (the MATH/PRM800K trailer), or None."""
    idx = text.rfind("The answer is")
    if idx < 0:
        return None
    m = _TRAILER.match(text, idx)
    return m.group(1) if m else None


def extract(text: str, version: str = EXTRACTOR_VERSION) -> str | None:
    """The final answer of a solution by the named extractor version (default: the current one), or None."""
    if version == "3":
        return _extract_v3(text)
    if version == "2":
        return _extract_v2(text)
    raise ValueError(f"unknown extractor version {version!r} (this kvgraft has {', '.join(EXTRACTOR_VERSIONS)})")


def _extract_v2(text: str) -> str | None:
    """Version 2: last boxed, else the trailer, else an "Answer:" line."""
    for get in (last_boxed, trailer):
        got = get(text)
        if got is not None and got.strip():
            return got
    m = None
    for m in _ANSWER.finditer(text):  # noqa: B007  (keeps the last match)
        pass
    return m.group(1) if m else None


# Version 3 statements (module docstring). Each captures the rest of its line from the end of the match.
_V3_PHRASE = re.compile(r"\banswer[ \t]+is\b[ \t]*:?", re.I)
_V3_LABEL = re.compile(r"^[ \t>#*_-]*(?:final[ \t]+)?answer[ \t]*(?:\*\*|__)?[ \t]*:[ \t]*(?:\*\*|__)?", re.I | re.M)
_V3_ASSIGN = re.compile(r"\banswer[ \t]*=(?!=)", re.I)
_V3_TAIL = re.compile(r"[ \t]*I hope it is correct\.?[ \t]*$", re.I)
_BOLD = re.compile(r"\*\*([^*]+)\*\*")
_BOLD_CLOSE = re.compile(r"([^*]+)\*\*")


def _boxed_all(text: str) -> list[tuple[int, str]]:
    """(start, content) of every balanced ``\\boxed{...}`` / ``\\fbox{...}`` and every bare ``\\boxed 5``."""
    found = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\" and i + 1 < len(text):
                i += 2
                continue
            depth += c == "{"
            depth -= c == "}"
            i += 1
        if depth == 0:
            found.append((m.start(), text[m.end() : i - 1]))
    found += [(m.start(), m.group(1)) for m in _BARE_BOXED.finditer(text)]
    return found


def _rest_of_line(text: str, end: int) -> str:
    """The text from ``end`` to the end of its line; the next non-empty line when that is blank."""
    nl = text.find("\n", end)
    rest = text[end:] if nl < 0 else text[end:nl]
    if rest.strip() or nl < 0:
        return rest
    for line in text[nl + 1 :].split("\n"):
        if line.strip():
            return line
    return ""


def _clean(s: str) -> str:
    """Presentation around a stated answer: the Minerva tail, trailing punctuation, whole-answer bold."""
    s = _V3_TAIL.sub("", s).strip()
    prev = None
    while prev != s:
        prev = s
        s = s.rstrip(".,;!").strip()
        m = _BOLD.fullmatch(s) or _BOLD_CLOSE.fullmatch(s)
        if m:
            s = m.group(1).strip()
    return s


def _extract_v3(text: str) -> str | None:
    """Version 3: the last final-answer statement by position (module docstring)."""
    cands = _boxed_all(text)
    for rx in (_V3_PHRASE, _V3_LABEL, _V3_ASSIGN):
        cands += [(m.start(), _clean(_rest_of_line(text, m.end()))) for m in rx.finditer(text)]
    # Latest start wins; at one start (a label that is also a phrase) the longer match was cleaned the same way.
    for _, got in sorted(cands, key=lambda c: c[0], reverse=True):
        if got.strip():
            return got
    return None


def extract_with(method: str, text: str) -> str | None:
    """Extract by a named method: ``verbatim``, ``boxed`` (last boxed) or ``trailer``."""
    if method == "verbatim":
        return text
    if method == "boxed":
        return last_boxed(text)
    if method == "trailer":
        return trailer(text)
    raise ValueError(f"unknown extraction method {method!r}")


def _strip_text_macros(s: str) -> str:
    # \text{cm} -> cm, \mbox{..}, \textbf{..}, \mathrm{..}: keep the content, drop the macro.
    prev = None
    while prev != s:
        prev = s
        s = re.sub(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", s)
    return s


def normalize(ans: str) -> str:
    """Canonical form of an answer for exact comparison (presentation removed, content kept)."""
    s = ans.strip()
    prev = None
    while prev != s:  # "$5$." and "5.$": periods and dollar signs in any order at the ends
        prev = s
        s = s.strip().strip("$").rstrip(".")
    s = _strip_text_macros(s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)  # not \leftarrow / \rightarrow
    s = s.replace("\u2212", "-")  # Unicode minus sign
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)  # degree signs
    s = s.replace("°", "")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    # Integers with thousands separators or leading zeros: 1,000 -> 1000, 007 -> 7.
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", s) or re.fullmatch(r"-?\d{1,3}(\{,\}\d{3})+", s):
        s = s.replace("{,}", "").replace(",", "")
    if re.fullmatch(r"-?0+\d*", s):
        s = ("-" if s.startswith("-") else "") + (s.lstrip("-").lstrip("0") or "0")
    return s


def answers_match(a: str, b: str) -> bool:
    """Exact equality after normalization."""
    return normalize(a) == normalize(b)
