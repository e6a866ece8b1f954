"""prefill.cut_before: a chunked schedule's chunk also ends before each named token (a chat's turn start), so a
shared prompt that ends at a turn is kept whole by a server's prompt cache, and every computation of a prompt, cold,
warm or by the schedule alone (what `replay --served` recomputes), runs the same forwards: same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPO

from kvgraft_cli.engine.engine import chunk_spans, closed_span, tensor_sha256

CHUNK = 8


def _manifest(tmp_path: Path, cut_before: list[str] | None, schedule: str = "chunked") -> Path:
    data = yaml.safe_load((REPO / "kvgraft_cli" / "data" / "default.yaml").read_text())
    data["prefill"] = {"schedule": schedule, "chunk_size": CHUNK}
    if cut_before is not None:
        data["prefill"]["cut_before"] = cut_before
    path = tmp_path / f"m-{schedule}-{len(cut_before or [])}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_spans_end_at_full_chunks_and_before_cut_tokens():
    ids = [5, 5, 5, 9, 5, 5, 5, 5, 5, 9, 5]
    assert chunk_spans(ids, 4) == [(0, 4), (4, 8), (8, 11)]
    spans = chunk_spans(ids, 4, frozenset({9}))
    assert spans == [(0, 3), (3, 7), (7, 9), (9, 11)]
    assert [closed_span(ids, s, 4, frozenset({9})) for s in spans] == [True, True, True, False]
    assert chunk_spans([9, 9, 5], 4, frozenset({9})) == [(0, 1), (1, 3)]  # a cut token starts a chunk, never empty
    assert chunk_spans(ids, len(ids)) == [(0, len(ids))]


def test_a_shared_prefix_ending_at_a_cut_is_restored_whole_with_the_same_bytes(tmp_path):
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.serve import promptcache
    from kvgraft_cli.store.local import Store

    plain = load_engine(load_manifest(_manifest(tmp_path, None)))
    turn = plain.tokenizer.convert_ids_to_tokens(plain.encode("Q")[0])  # the token that starts every question here
    engine = load_engine(load_manifest(_manifest(tmp_path, [turn])))
    shared = engine.prefix_ids("Problem: add the first ten odd numbers.\nSolution: 1+3+5+...+19 = 100.\n" * 2)
    first = shared + engine.encode("Q: and the first five?")  # the two differ right after the cut token
    second = shared + engine.encode("Q! what of twenty, twice over?")
    assert len(shared) % CHUNK and engine.prefill_cuts == {first[len(shared)]}

    def answer(eng, ids, store):
        pre = promptcache.prefill(eng, store, ids, CHUNK)
        gen, steps = eng.greedy(pre.cache, pre.last_logits, 5)
        return pre, tensor_sha256(pre.last_logits) + tensor_sha256(steps)

    def by_schedule(eng, ids):  # the manifest's schedule alone, no cache (replay --served, --no-prompt-cache)
        cache, last = eng.prefill(ids)
        return tensor_sha256(last) + tensor_sha256(eng.greedy(cache, last, 5)[1])

    store = Store(tmp_path / "store")
    cold, got = answer(engine, first, store)
    assert got == by_schedule(engine, first)
    warm, got = answer(engine, second, store)
    assert warm.restored_tokens == len(shared)  # the whole shared prompt: its last chunk ends at the cut
    assert got == answer(engine, second, Store(tmp_path / "cold"))[1] == by_schedule(engine, second)
    # the same prompts under the schedule without the cut: the shared prompt's last chunk is computed again
    store = Store(tmp_path / "plain")
    answer(plain, first, store)
    again, got = answer(plain, second, store)
    assert again.restored_tokens == len(shared) // CHUNK * CHUNK < len(shared)
    assert got == by_schedule(plain, second)


def test_cut_before_is_refused_outside_the_chunked_schedule_and_for_no_single_token(tmp_path):
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.errors import InputError, KvgraftError

    with pytest.raises(KvgraftError, match="prefill.cut_before: only the chunked schedule cuts chunks"):
        load_manifest(_manifest(tmp_path, ["<bos>"], schedule="single"))
    with pytest.raises(InputError, match="prefill.cut_before: 'not one token' is not one token"):
        load_engine(load_manifest(_manifest(tmp_path, ["not one token"])))


@pytest.mark.parametrize(
    "prefill, chunk",
    [
        ({"schedule": "chunked", "chunk_size": 8}, 8),
        ({"schedule": "single"}, None),
        ({"schedule": "invariant"}, 256),
    ],
)
def test_the_prompt_caches_chunk_follows_the_schedule(tmp_path, prefill, chunk):
    """serve's prompt-cache chunk (serve.promptcache.chunk_of), from the manifest's prefill section alone: a chunked
    schedule's own, the server's default under invariant, none under single (no exact split)."""
    from types import SimpleNamespace

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.serve.promptcache import chunk_of

    path = _manifest(tmp_path, None)
    data = yaml.safe_load(path.read_text())
    data["prefill"] = prefill
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert chunk_of(SimpleNamespace(manifest=load_manifest(path))) == chunk
