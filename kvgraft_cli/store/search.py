"""Related library entries with bounded work per query (#26 §3): whatever the library's size, a search runs at most
:data:`MAX_STATEMENTS` SQL statements of its own, reads at most :data:`PROBE_ROWS` index rows per word and
:data:`GRAM_ROWS` per word sequence, and ranks at most :data:`RANK_ROWS` problems.

How (over problems only; solutions are not matched):

1. The query's distinct words (letters and digits, lower-cased, as FTS5's unicode61 tokenizer splits them; at most
   :data:`MAX_TERMS`, longest first) are each looked up in the FTS5 index with a capped scan: a word in fewer than
   PROBE_ROWS problems is *rare* and its problems are read; a word in more is *common*, and only that is known.
2. Its word sequences: every four consecutive words with numbers and single letters masked (:func:`grams`, so a new
   instance of a problem, other numbers or other variable names, has the same sequences), hashed, each looked up in
   the ``library_grams`` table: at most :data:`MAX_GRAMS` sequences, for each the GRAM_ROWS problems that hold it
   and have the nearest number of sequences to the query's (half at or above it, half below), in one statement that
   scores each problem by the share of sequences it has in common with the query (shared / union). A problem's
   sequences are rare even when all its words are common, and a problem that says the query's sentence and more
   comes after the one that says just it: that is what finds the source among a million problems made of the same
   sentences.
3. Candidates are ordered by that share, then rare-word weight; the first RANK_ROWS are read and ranked by
   bm25 (FTS5's formula: k1 = 1.2, b = 0.75, idf = ln((N - n + 0.5) / (n + 0.5)), at least 1e-6) over the query's
   words, N and the mean problem length from FTS5's own totals record, n capped at PROBE_ROWS for common words.
   The relevance is that bm25 times (1 + the share of sequences from step 2), so of two problems with the query's
   words, the one that says them in the query's order, and no more, comes first. A number (a word of digits only)
   weighs NUMBER_WEIGHT of its idf: a new instance of a problem changes its
   numbers and keeps its words, so matching numbers by chance must not outrank matching the words. A word's count
   in a problem counts up to its count in the query: a problem that repeats the query's words (the query's sentence
   and more) matches no better than one that says them once, and its length then ranks it below.

The score is reported as FTS5 reports bm25, negated (lower is better), so ``min_score`` is a minimum relevance.
"""

from __future__ import annotations

import hashlib
import math
import re
import sqlite3
from dataclasses import dataclass

MAX_TERMS = 32  # distinct query words probed (a MATH-500 problem has 22 on average)
PROBE_ROWS = 256  # rows one statement may read; a word in more problems than this is common
RANK_ROWS = 64  # problems read and ranked per query
GRAM = 4  # words per sequence
MAX_GRAMS = 32  # sequences of a query looked up
GRAM_ROWS = 256  # problems read per sequence
MAX_STATEMENTS = 1 + MAX_TERMS + 1 + 1  # totals, word probes, sequences, the ranked rows
NUMBER_WEIGHT = 0.1  # a number's share of its idf: a new instance of a problem changes its numbers, not its words
K1, B = 1.2, 0.75
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


@dataclass
class Work:
    """What one search did: its own statements, index rows read by the word probes and the sequence lookup, problems
    ranked."""

    statements: int = 0
    rows_read: int = 0
    rows_ranked: int = 0


def words(text: str) -> list[str]:
    """Lower-cased words in order (letters and digits runs, as unicode61 splits them)."""
    return [w.lower() for w in _WORD.findall(text)]


def grams(text: str) -> list[int]:
    """The distinct GRAM-word sequences of ``text``, numbers and single letters masked, as signed 64-bit hashes, in
    order of first appearance (a text shorter than GRAM words: itself, masked, as one sequence)."""
    return list(dict.fromkeys(h for _, h in _sequences(text)))


def _sequences(text: str) -> list[tuple[int, int]]:
    """(unmasked characters, hash) of each GRAM-word sequence of ``text``, in order."""
    masked = ["0" if w.isdigit() else "a" if len(w) == 1 else w for w in words(text)]
    seqs = [masked[i : i + GRAM] for i in range(max(1, len(masked) - GRAM + 1))] if masked else []
    return [
        (
            sum(len(w) for w in g if len(w) > 1),
            int.from_bytes(hashlib.blake2b(" ".join(g).encode(), digest_size=8).digest(), "big", signed=True),
        )
        for g in seqs
    ]


def _informative(text: str) -> tuple[list[int], int]:
    """At most MAX_GRAMS of the query's distinct sequences, those with the most unmasked characters first; and how
    many distinct sequences it has in all (``len(grams(text))``, without hashing them twice)."""
    best: dict[int, int] = {}
    for chars, h in _sequences(text):
        best.setdefault(h, chars)
    return sorted(best, key=lambda h: -best[h])[:MAX_GRAMS], len(best)


def phrase(w: str) -> str:
    """``w`` as one quoted FTS5 phrase (a word's text is never FTS5 syntax)."""
    return '"' + w.replace('"', '""') + '"'


def search(
    db: sqlite3.Connection,
    text: str,
    fetch_sql: str,
    fetch_args: tuple,
    work: Work | None = None,
    sequences: bool = True,
) -> list[tuple[float, tuple]]:
    """Rank library problems against ``text``; returns (bm25, row) best first, at most RANK_ROWS, where row is what
    ``fetch_sql`` (a SELECT whose first column is the library rowid and second the problem text, with a ``{ids}``
    placeholder for the candidate rowids, and filters such as the compute pin bound by ``fetch_args``) returns.
    ``sequences``: whether the store has library_grams (a store too old, opened read-only, has not)."""
    work = work if work is not None else Work()
    qtf: dict[str, int] = {}
    for w in words(text):
        qtf[w] = qtf.get(w, 0) + 1
    query = list(qtf)
    probed = sorted(query, key=len, reverse=True)[:MAX_TERMS]
    if not probed:
        return []
    n_docs, avg_len = _totals(db, work)
    if n_docs == 0:
        return []
    idf: dict[str, float] = {}  # of every probed word found at all; bm25 below weighs the candidates with it
    weight: dict[int, float] = {}
    for w in probed:
        rows = _rows(db, f"problem : {phrase(w)}", work)
        if rows:
            idf[w] = _idf(n_docs, len(rows)) * (NUMBER_WEIGHT if w.isdigit() else 1.0)
        if len(rows) < PROBE_ROWS:
            for r in rows:
                weight[r] = weight.get(r, 0.0) + idf[w]
    shared = _shared_sequences(db, *_informative(text), work) if sequences else {}
    picked = sorted(set(weight) | set(shared), key=lambda r: (-shared.get(r, 0), -weight.get(r, 0.0), r))[:RANK_ROWS]
    if not picked:
        return []
    work.statements += 1
    fetched = db.execute(fetch_sql.format(ids=",".join("?" * len(picked))), (*picked, *fetch_args)).fetchall()
    work.rows_ranked += len(fetched)
    scored = [(-_bm25(row[1], idf, qtf, avg_len) * (1.0 + shared.get(row[0], 0.0)), row) for row in fetched]
    scored.sort(key=lambda s: (s[0], s[1][0]))
    return scored


def _rows(db: sqlite3.Connection, match: str, work: Work) -> list[int]:
    work.statements += 1
    rows = [
        r[0] for r in db.execute("SELECT rowid FROM library_fts WHERE library_fts MATCH ? LIMIT ?", (match, PROBE_ROWS))
    ]
    work.rows_read += len(rows)
    return rows


def _shared_sequences(db: sqlite3.Connection, hashes: list[int], size: int, work: Work) -> dict[int, float]:
    """The RANK_ROWS library rows most like the query by sequences: for each of ``hashes``, the GRAM_ROWS problems
    holding it whose count of distinct sequences is nearest the query's ``size`` (half from ``size`` up, half from
    just below it down); each problem's share of sequences with the query (shared / union, 1.0 for the same
    sequences). One statement, which also reports the rows it read."""
    if not hashes:
        return {}
    work.statements += 1
    up = "SELECT * FROM (SELECT entry, size FROM library_grams WHERE gram = ? AND size >= ? ORDER BY size LIMIT ?)"
    down = (
        "SELECT * FROM (SELECT entry, size FROM library_grams WHERE gram = ? AND size < ? ORDER BY size DESC LIMIT ?)"
    )
    sql = (
        "SELECT entry, count(*) * 1.0 / (? + max(size) - count(*)) AS j, sum(count(*)) OVER () FROM ("
        + " UNION ALL ".join([up, down] * len(hashes))
        + ") GROUP BY entry ORDER BY j DESC, entry LIMIT ?"
    )
    half = GRAM_ROWS // 2
    args = [size] + [v for h in hashes for v in (h, size, half, h, size, half)] + [RANK_ROWS]
    rows = db.execute(sql, args).fetchall()
    work.rows_read += rows[0][2] if rows else 0
    return {r[0]: r[1] for r in rows}


def _totals(db: sqlite3.Connection, work: Work) -> tuple[int, float]:
    """(rows, mean problem length in tokens) from FTS5's totals record (its %_data row 1: varints of the row count
    and each column's total tokens), read in one statement whatever the index's size."""
    work.statements += 1
    row = db.execute("SELECT block FROM library_fts_data WHERE id = 1").fetchone()
    if not row or not row[0]:
        return 0, 1.0
    values: list[int] = []
    blob, i = bytes(row[0]), 0
    while i < len(blob) and len(values) < 2:
        v, i = _varint(blob, i)
        values.append(v)
    n = values[0] if values else 0
    return n, (values[1] / n if n and len(values) > 1 else 1.0)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    """SQLite's varint (as FTS5 writes it): big-endian 7-bit groups, the ninth byte whole."""
    v = 0
    for j in range(8):
        c = b[i + j]
        v = (v << 7) | (c & 0x7F)
        if not c & 0x80:
            return v, i + j + 1
    return (v << 8) | b[i + 8], i + 9


def _idf(n_docs: int, n: int) -> float:
    return max(1e-6, math.log((n_docs - n + 0.5) / (n + 0.5)))


def _bm25(problem: str, idf: dict[str, float], qtf: dict[str, int], avg_len: float) -> float:
    toks = words(problem)
    tf: dict[str, int] = {}
    for t in toks:
        if t in idf:
            tf[t] = tf.get(t, 0) + 1
    norm = K1 * (1 - B + B * len(toks) / max(avg_len, 1e-9))
    return sum(idf[t] * f * (K1 + 1) / (f + norm) for t, f in ((t, min(f, qtf[t])) for t, f in tf.items()))
