"""The prompt cache's bound in the store (store.eviction), in process on the embedded tiny model: which chunks go
first, that a chunk's continuations go with it, that nothing else in the store is ever evicted, and the two races a
shared store meets (a reader whose chunk is unlinked under it: a miss; a writer whose object is evicted between its
look and its index: written again). Servers under load and kill -9 mid-eviction are in test_serve_bounded.py."""

from __future__ import annotations

import pytest

from kvgraft_cli.serve import promptcache
from kvgraft_cli.store import eviction
from kvgraft_cli.store.local import PROMPT_CHUNK_ID, Store

CHUNK = 16


def _chunks(store: Store) -> dict[str, str]:
    """key -> artifact of every prompt-chunk entry."""
    rows = store._db.execute("SELECT key, artifact FROM entries WHERE problem_id = ?", (PROMPT_CHUNK_ID,))
    return dict(rows.fetchall())


def _prefill(engine, store: Store, text: str, scope: str | None = None) -> promptcache.Prefilled:
    return promptcache.prefill(engine, store, engine.encode(text), CHUNK, None, scope)


def _use(pre: promptcache.Prefilled, t: float) -> dict:
    return {k: (pre.keys[i - 1] if i else None, t) for i, k in enumerate(pre.keys)}


def test_least_recently_used_first_with_every_chunk_that_continues_it(engine, tmp_path):
    with Store(tmp_path / "store") as store:
        a = _prefill(engine, store, "A" * 60)  # three closed chunks: a0 <- a1 <- a2
        b = _prefill(engine, store, "B" * 40)  # two: b0 <- b1
        assert len(a.keys) == 3 and len(b.keys) == 2
        eviction.touch(store, _use(a, 1.0))
        eviction.touch(store, _use(b, 2.0))
        total = eviction.cache_bytes(store)

        gone = eviction.evict(store, total - 1)  # one chunk over: the oldest, deepest first (a2)
        assert gone.keys == [a.keys[2]] and gone.files == 1 and gone.remaining == total - gone.bytes
        assert not store.has_object(a.chain[2]) and store.has_object(a.chain[1])

        eviction.touch(store, {a.keys[1]: (a.keys[0], 3.0)})  # a1 used after b: a0 is now the oldest
        gone = eviction.evict(store, gone.remaining - 1)
        assert gone.keys == [a.keys[0], a.keys[1]]  # a1 goes with its parent (unreachable without it)
        assert set(_chunks(store)) == set(b.keys)
        assert eviction.evict(store, 10 * total).chunks == 0  # under the bound: nothing goes


def test_an_eviction_is_one_transaction(engine, tmp_path, monkeypatch):
    """Every row deleted and file unlinked while the eviction's write transaction is open (a kill -9 rolls the rows
    back; a writer cannot index an object being unlinked)."""
    with Store(tmp_path / "store") as store:
        pre = _prefill(engine, store, "G" * 60)
        eviction.touch(store, _use(pre, 1.0))
        drop, seen = eviction._drop, []

        def watched(s, key, artifact):
            seen.append(s._db.in_transaction)
            return drop(s, key, artifact)

        monkeypatch.setattr(eviction, "_drop", watched)
        assert eviction.evict(store, 0).chunks == 3
        assert seen == [True, True, True]


def test_nothing_but_prompt_chunks_is_evicted(engine, tmp_path):
    """An object a deposit's entry also names keeps its file when the chunk entry naming it goes."""
    with Store(tmp_path / "store") as store:
        pre = _prefill(engine, store, "C" * 40)
        sha = pre.chain[0]
        entry = store.lookup_key(pre.keys[0])
        assert entry is not None
        store.index(
            sha,
            payload_bytes=1,
            key="a-deposit-of-the-same-bytes",
            problem_id="p1",
            num_tokens=entry.num_tokens,
            model_sha256="0" * 64,
            manifest_sha256=entry.manifest_sha256,
            verified=True,
        )
        gone = eviction.evict(store, 0)
        assert gone.chunks == 2 and gone.files == 1 and gone.remaining == 0
        assert _chunks(store) == {} and store.has_object(sha) and not store.has_object(pre.chain[1])
        assert store.lookup_key("a-deposit-of-the-same-bytes") is not None


def test_a_chunk_unlinked_under_a_reader_is_a_miss(engine, tmp_path, monkeypatch):
    """Another server evicts the chunk between this one's look at its file and its read: the prompt is computed
    from there (a miss), the chunk not refused as damaged."""
    from kvgraft_cli.store.local import VERIFIED

    with Store(tmp_path / "store") as store:
        text = "D" * 50
        cold = _prefill(engine, store, text)
        VERIFIED.clear()
        load = Store.load

        def evicted_meanwhile(self, sha256, *a, **k):
            self.object_path(sha256).unlink(missing_ok=True)
            return load(self, sha256, *a, **k)

        monkeypatch.setattr(Store, "load", evicted_meanwhile)
        warm = _prefill(engine, store, text)
        assert warm.refused == [] and warm.restored == []
        assert warm.last_logits.numpy().tobytes() == cold.last_logits.numpy().tobytes()
        assert warm.deposited == cold.chain[:1] and warm.chain == cold.chain  # the gone chunk written again
        assert all(store.has_object(s) for s in cold.chain)


def test_an_object_evicted_before_its_index_row_is_written_again(engine, tmp_path, monkeypatch):
    with Store(tmp_path / "store") as store:
        index = Store.index
        calls = []

        def evicted_first(self, sha256, **rows):
            if not calls:
                self.object_path(sha256).unlink()
            calls.append(sha256)
            return index(self, sha256, **rows)

        monkeypatch.setattr(Store, "index", evicted_first)
        pre = _prefill(engine, store, "E" * 20)
        assert len(calls) == 2 and calls[0] == calls[1]  # refused once, written again, indexed
        assert store.has_object(pre.chain[0]) and store.lookup_key(pre.keys[0]) is not None


@pytest.mark.parametrize("scope", [None, "ab" * 32])
def test_a_scope_keys_every_chunk_of_its_chain(engine, tmp_path, scope):
    with Store(tmp_path / "store") as store:
        text = "F" * 40
        first = _prefill(engine, store, text, scope)
        other = _prefill(engine, store, text, "cd" * 32)
        same = _prefill(engine, store, text, scope)
        assert other.restored == [] and len(same.restored) == 2
        assert not set(other.keys) & set(first.keys)
        # Objects of its own: no file or verified memory shared (a warm request's time says nothing of another's)
        assert not set(other.chain) & set(first.chain)
        assert other.last_logits.numpy().tobytes() == first.last_logits.numpy().tobytes()
