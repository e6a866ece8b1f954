"""A graft's cache grows in place on the CPU (engine/growcache.py): the same logits bits as DynamicLayer's
concatenation (and as a fresh computation), written into buffers of its own, never into the artifact's tensors."""

from __future__ import annotations

import pytest
import torch

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.engine import growcache
from kvgraft_cli.engine.engine import tensor_sha256


@pytest.fixture(scope="module")
def grafted(engine):
    prefix = engine.prefix_ids("Problem: add the first ten odd numbers.\nSolution: 1+3+5+...+19 = 100.\n")
    cache, _ = engine.prefill(prefix)
    payload = kvg.encode(prefix, engine.capture(cache), engine.artifact_meta("0" * 64))
    return prefix, kvg.decode(bytearray(payload))


def _decode(engine, cache, suffix, steps: int):
    """Logits of the suffix and of ``steps`` greedy tokens after it, stacked."""
    out = [engine.forward(cache, suffix)]
    for _ in range(steps):
        out.append(engine.forward(cache, [int(out[-1][-1].argmax())]))
    return torch.cat(out)


def test_growing_in_place_gives_the_bits_of_concatenation_and_of_fresh(engine, grafted, monkeypatch):
    """Room for 3 tokens at a time, so 20 decode steps move to new buffers 5 times: every logit is byte-equal to
    the DynamicLayer graft and to the fresh cache, and the layers hold views of their own buffers."""
    prefix, art = grafted
    suffix = engine.encode("\nQuestion: and the first twenty?\nAnswer:")
    monkeypatch.setattr(growcache, "SLACK_TOKENS", 3)
    made = []
    real = growcache._zeroed
    monkeypatch.setattr(growcache, "_zeroed", lambda like, n: made.append(n) or real(like, n))
    cache = engine.restore(art.layers)
    full = [layer for layer in cache.layers if isinstance(layer, growcache.layer_class())]
    assert full, "the embedded model has full-attention layers: they must grow in place"
    grown = _decode(engine, cache, suffix, 20)
    assert all(l.keys.data_ptr() == l._kbuf.data_ptr() and l.keys.shape[-2] == len(prefix) + len(suffix) + 20
               for l in full)
    # Keys and values: the first update (the suffix) moves into a buffer with room for 3 more, then every 4th
    # decode step moves again: 1 + 20 / 4 buffers each.
    assert sorted(made) == sorted([len(prefix) + len(suffix) + 3 + 4 * k for k in range(6) for _ in range(2)] * len(full))

    monkeypatch.setenv("KVGRAFT_GROW_IN_PLACE", "0")
    concatenated = engine.restore(art.layers)
    assert not any(isinstance(l, growcache.layer_class()) for l in concatenated.layers)
    fresh, _ = engine.prefill(prefix)
    assert tensor_sha256(grown) == tensor_sha256(_decode(engine, concatenated, suffix, 20)) \
        == tensor_sha256(_decode(engine, fresh, suffix, 20))


def test_the_first_update_copies_the_artifact_and_never_writes_into_it(engine, grafted):
    _, art = grafted
    before = [(l.keys.clone(), l.values.clone()) for l in art.layers if l.kind == "full"]
    cache = engine.restore(art.layers)
    engine.forward(cache, engine.encode(" more"))
    after = [(l.keys, l.values) for l in art.layers if l.kind == "full"]
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(before, after))
    assert all(l.keys.data_ptr() != a.data_ptr() for l, (a, _) in
               zip([l for l in cache.layers if isinstance(l, growcache.layer_class())], after))


def test_not_on_cuda_and_off_by_environment(monkeypatch):
    assert growcache.enabled("cpu") and not growcache.enabled("cuda") and not growcache.enabled("cuda:1")
    monkeypatch.setenv("KVGRAFT_GROW_IN_PLACE", "0")
    assert not growcache.enabled("cpu")
