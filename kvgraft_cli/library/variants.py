"""Variants of a problem statement, for measuring the library's lookups on real text (tests and
benchmarks/bench_retrieval.py): formatting variants that must stay exact hits, near duplicates that must never be one
(one number changed, a sign flipped, a variable renamed, a condition added or removed), and filler problems made by
recombining and perturbing real problems' sentences.

Every function is deterministic given its ``random.Random``. A near-duplicate function returns None when the edit does
not apply to the text (no number to change, no variable to rename, ...); otherwise its result differs from the input
in more than whitespace, which the caller may check.
"""

from __future__ import annotations

import random
import re
import string

_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")  # a free-standing integer or decimal, not part of a name
_MATH = re.compile(r"\$[^$]+\$")  # inline TeX math, where single-letter variables live
_VARIABLE = re.compile(r"(?<![\\A-Za-z])[a-zA-Z](?![A-Za-z])")  # one letter, not a TeX command's
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z$\\])")
CONDITIONS = (
    "Assume that all variables are positive integers.",
    "Assume $x \\neq 0$.",
    "You may assume the answer is an integer.",
    "Suppose further that $n$ is odd.",
    "Give your answer in simplest radical form.",
    "All angles are measured in degrees.",
)


# -- formatting variants: the same normalized text --------------------------------------------------------------------


def whitespace_variants(text: str) -> list[str]:
    """Spellings of ``text`` that differ only in whitespace: runs doubled, spaces as newlines, tabs and no-break
    spaces, CRLF line ends, padding at both ends (the same words as ``text``, as ``str.split()`` reads them)."""
    words = text.split()
    return [
        "  ".join(words),
        "\n".join(words),
        "\t".join(words),
        "\u00a0".join(words),  # no-break space: Unicode whitespace, as str.split() reads it
        " \r\n ".join(words),
        "\n\n  " + " ".join(words) + "  \n",
        "\u2009".join(words) + "\u3000",  # thin space, ideographic space
    ]


# -- near duplicates: a different problem ----------------------------------------------------------------------------


def change_number(text: str, rng: random.Random) -> str | None:
    """One number replaced by another (the same number of decimals)."""
    spots = list(_NUMBER.finditer(text))
    if not spots:
        return None
    m = rng.choice(spots)
    return text[: m.start()] + _other_number(m.group(), rng) + text[m.end() :]


def change_all_numbers(text: str, rng: random.Random) -> str | None:
    """Every number replaced by another: a new instance of the same problem."""
    if not _NUMBER.search(text):
        return None
    return _NUMBER.sub(lambda m: _other_number(m.group(), rng), text)


def flip_sign(text: str, rng: random.Random) -> str | None:
    """One number negated (``5`` -> ``-5``, or ``-5`` -> ``5``), or one ``+`` turned into ``-`` inside math."""
    spots: list[tuple[str, re.Match[str] | int]] = [("num", m) for m in _NUMBER.finditer(text)]
    for mm in _MATH.finditer(text):
        spots += [("op", mm.start() + i) for i, c in enumerate(mm.group()) if c == "+"]
    if not spots:
        return None
    kind, where = rng.choice(spots)
    if isinstance(where, int):  # kind "op": a "+" at this index
        return text[:where] + "-" + text[where + 1 :]
    if where.start() > 0 and text[where.start() - 1] == "-":
        return text[: where.start() - 1] + text[where.start() :]
    return text[: where.start()] + "-" + text[where.start() :]


def rename_variable(text: str, rng: random.Random) -> str | None:
    """One single-letter variable renamed, everywhere it occurs inside ``$...$``, to a letter the text does not use."""
    found = {m.group() for mm in _MATH.finditer(text) for m in _VARIABLE.finditer(mm.group())}
    if not found:
        return None
    old = rng.choice(sorted(found))
    used = set(re.findall(r"[a-zA-Z]", text))
    free = [c for c in (string.ascii_lowercase if old.islower() else string.ascii_uppercase) if c not in used]
    if not free:
        return None
    new = rng.choice(free)
    return _MATH.sub(lambda mm: _VARIABLE.sub(lambda m: new if m.group() == old else m.group(), mm.group()), text)


def add_condition(text: str, rng: random.Random) -> str:
    """A condition appended as one more sentence."""
    return text.rstrip() + " " + rng.choice(CONDITIONS)


def remove_condition(text: str, rng: random.Random) -> str | None:
    """One sentence of several dropped, or else one inline formula (``$...$``) of several dropped."""
    sentences = _SENTENCE_END.split(text.strip())
    if len(sentences) > 1:
        i = rng.randrange(len(sentences))
        return " ".join(sentences[:i] + sentences[i + 1 :])
    formulas = list(_MATH.finditer(text))
    if len(formulas) > 1:
        m = rng.choice(formulas)
        return text[: m.start()] + text[m.end() :]
    return None


NEAR_DUPLICATES = {
    "number changed": change_number,
    "sign flipped": flip_sign,
    "variable renamed": rename_variable,
    "condition added": add_condition,
    "condition removed": remove_condition,
}


def near_duplicates(text: str, rng: random.Random) -> dict[str, str]:
    """Each near-duplicate edit that applies to ``text`` and changes more than its whitespace, by name."""
    out = {}
    for name, edit in NEAR_DUPLICATES.items():
        v = edit(text, rng)
        if v is not None and v.split() != text.split():
            out[name] = v
    return out


# -- filler: text that looks like problems ----------------------------------------------------------------------------


def sentences(text: str) -> list[str]:
    """A problem statement cut into sentences (at ``.``, ``?`` or ``!`` followed by space and a capital, ``$`` or
    ``\\``)."""
    return [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]


def filler(pool: list[list[str]], vocabulary: list[str], rng: random.Random, swap: float = 0.3) -> str:
    """A problem-like text: one sentence from each of two or three different problems of ``pool`` (each problem a
    list of sentences; a sentence of at least three words where the problem has one, so that no filler is a single
    problem's sentence plus a wordless fragment: a twin of that problem with other numbers), every number redrawn, and each word replaced with probability ``swap`` by a word drawn
    from ``vocabulary`` (a list with repeats, so common words are drawn often). It reads like a problem and shares
    most of its words, and whole sentences, with real ones; it is the same as none of them."""
    picks = rng.sample(range(len(pool)), rng.choice((2, 2, 3)))
    parts = [rng.choice([s for s in pool[i] if len(re.findall(r"[A-Za-z]{2,}", s)) >= 3] or pool[i]) for i in picks]
    text = " ".join(parts)
    text = _NUMBER.sub(lambda m: _other_number(m.group(), rng), text)
    return re.sub(r"[A-Za-z]{2,}", lambda m: rng.choice(vocabulary) if rng.random() < swap else m.group(), text)


def _other_number(num: str, rng: random.Random) -> str:
    """A number other than ``num``, of the same shape (integer, or as many decimals)."""
    if "." in num:
        whole, frac = num.split(".")
        digits = str(rng.randrange(10 ** len(frac))).zfill(len(frac))
        out = f"{_other_number(whole, rng) if rng.random() < 0.5 else whole}.{digits}"
        return out if out != num else f"{int(whole) + 1}.{frac}"
    n = int(num)
    scale = max(10, 10 ** len(num))
    m = rng.randrange(scale)
    return str(m if m != n else n + 1)
