"""Final-answer extraction and normalization for math solutions.

Used by deposit to verify a solution against its reference answer. Extraction: the last ``\\boxed{...}`` (or
``\\fbox{...}``), nested braces handled; fallbacks "The answer is: ..." and "Answer: ...". Normalization removes
presentation only (spaces, ``\\left``/``\\right``, ``\\text{}``, ``\\dfrac``, thousands separators, a trailing
period, degree signs, ``$``), then answers are compared exactly.
"""

from __future__ import annotations

import re

EXTRACTOR_VERSION = "2"

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
    for bare in _BARE_BOXED.finditer(text):
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


def extract(text: str) -> str | None:
    """The final answer of a solution: last boxed, else the trailer, else an "Answer:" line."""
    for get in (last_boxed, trailer):
        got = get(text)
        if got is not None and got.strip():
            return got
    m = None
    for m in _ANSWER.finditer(text):
        pass
    return m.group(1) if m else None


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
