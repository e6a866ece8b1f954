"""The library index: verified entries only, exact hits by normalized problem text, bm25 retrieval, FTS rows written
and removed with their library rows, any problem text safe as a query."""

from __future__ import annotations

import shutil

import pytest

from kvgraft_cli.eval.problems import normalize_key
from kvgraft_cli.library.retrieval import find
from kvgraft_cli.store import search
from kvgraft_cli.store.local import Store, problem_key


@pytest.fixture
def store_copy(tmp_path, deposited):
    ctx, report = deposited
    shutil.copytree(ctx.store, tmp_path / "store")
    return ctx, report, tmp_path / "store"


def _fts_rows(store: Store) -> int:
    """Rows of the library, after FTS5's own check that its index matches them exactly (an index row left behind
    by a deleted entry, or a missing one, raises)."""
    store._db.execute("INSERT INTO library_fts(library_fts, rank) VALUES ('integrity-check', 1)")
    return store._db.execute("SELECT count(*) FROM library_fts").fetchone()[0]


def test_only_verified_deposits_enter_the_library(store_copy):
    ctx, report, path = store_copy
    verified = [r for r in report.results if r.status in ("deposited", "existing") and r.verified]
    with Store(path) as s:
        assert s.library_size() == len(verified) == 7
        assert _fts_rows(s) == 7
        assert s.library_size(ctx.manifest.compute_sha256) == 7 and s.library_size("0" * 64) == 0


def test_exact_hit_ignores_whitespace_and_pin(store_copy, engine):
    ctx, _, path = store_copy
    with Store(path) as s:
        sample = s._db.execute("SELECT problem, problem_id FROM library WHERE problem_id = 'sum-1'").fetchone()
        spaced = "  " + sample[0].replace(" ", "   ") + "\n"
        found = find(s, spaced, ctx.manifest.compute_sha256)
        assert found.kind == "exact" and found.hits[0].problem_id == "sum-1"
        assert s.library_exact(problem_key("f" * 64, normalize_key(sample[0]))) is None  # another compute pin


def test_related_ranks_by_bm25_and_respects_k(store_copy):
    ctx, _, path = store_copy
    with Store(path) as s:
        probe = s._db.execute("SELECT problem FROM library WHERE problem_id = 'gcd-1'").fetchone()[0]
        asked = probe + " (asked differently)"
        hits = s.library_search(asked, ctx.manifest.compute_sha256, 3)
        assert hits and hits[0].problem_id == "gcd-1" and len(hits) <= 3
        assert [h.score for h in hits] == sorted(h.score for h in hits)  # bm25: lower is better
        assert s.library_search(asked, ctx.manifest.compute_sha256, 3, min_score=-hits[0].score + 1e-9) == []
        assert s.library_search("zzzz qqqq", ctx.manifest.compute_sha256, 3) == []


@pytest.mark.parametrize("text", ['He said "hi" AND NOT', "x* NEAR(a b) ^ -1 : {}", "((((", "'", "", "日本語 の 問題"])
def test_any_text_is_a_safe_query(store_copy, text):
    ctx, _, path = store_copy
    with Store(path) as s:
        s.library_search(text, ctx.manifest.compute_sha256, 2)  # never an FTS5 syntax error
    # a word is a run of letters and digits, never FTS5 syntax; a phrase doubles any quote inside it
    assert search.words('say "hi" AND NOT x*') == ["say", "hi", "and", "not", "x"]
    assert search.phrase('a"b OR c') == '"a""b OR c"'
