"""Chains: several library solutions in one context, byte-exact against the same segments prefilled fresh."""

from __future__ import annotations

import pytest

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.engine.engine import tensor_sha256
from kvgraft_cli.errors import ArtifactError
from kvgraft_cli.library.chain import build_chain
from kvgraft_cli.runs.graft import graft_check, prefill_chain
from kvgraft_cli.store.local import Store, check_chain


@pytest.fixture
def library(deposited):
    """The session store's library entries (7 verified examples), read-only."""
    ctx, _ = deposited
    with Store(ctx.store, create=False) as s:
        hits = [s.library_exact(k) for k in _keys(s)]
    return ctx, hits


def _keys(store: Store) -> list[str]:
    return [r[0] for r in store._db.execute("SELECT problem_key FROM library ORDER BY rowid")]


@pytest.fixture
def chain_store(tmp_path, deposited):
    """A copy of the session store, so chain links can be written into it."""
    import shutil

    ctx, _ = deposited
    shutil.copytree(ctx.store, tmp_path / "store")
    return tmp_path / "store"


def test_chain_of_three_grafts_exactly(engine, ctx, library, chain_store):
    _, hits = library
    with Store(chain_store) as store:
        chain = build_chain(store, engine, hits[:3])
    assert len(chain.links) == 3 and len(chain.new_links) == 2
    starts = [a.start for a in chain.artifacts]
    assert starts[0] == 0 and starts[1] == chain.artifacts[0].num_tokens
    assert starts[2] == starts[1] + chain.artifacts[1].num_tokens
    assert chain.artifacts[2].parent == chain.shas[1] and chain.artifacts[1].parent == chain.shas[0]
    c = type(ctx).make(ctx.manifest, chain_store, ctx.ledger)
    report = graft_check(c, engine, chain.shas[-1], samples=50, max_new_tokens=4)
    assert report.passed and report.sha_equal == 50 and report.max_kl == 0.0
    assert report.deposit_reproduced and report.logits_reproduced
    assert report.prefix_tokens == chain.num_tokens


def test_restored_chain_equals_segments_prefilled_in_place(engine, library, chain_store):
    _, hits = library
    with Store(chain_store) as store:
        chain = build_chain(store, engine, hits[1:4])
    fresh, _ = prefill_chain(engine, chain.artifacts)
    grafted = engine.restore_chain(chain.artifacts)
    suffix = engine.encode("\nQuestion: and then?\nAnswer:")
    assert tensor_sha256(engine.forward(fresh, suffix)) == tensor_sha256(engine.forward(grafted, suffix))


def test_a_link_is_not_its_segment_prefilled_alone(engine, library, chain_store):
    """Negative control: the same segment computed at position 0 on its own is another cache (the reason for
    chains), and grafting it after the parent gives other logits."""
    _, hits = library
    with Store(chain_store) as store:
        chain = build_chain(store, engine, hits[:2])
    link = chain.artifacts[1]
    alone, _ = engine.prefill(link.token_ids)
    suffix = engine.encode("\nQuestion: x\nAnswer:")
    right = engine.forward(engine.restore_chain(chain.artifacts), suffix)
    # Put the separately computed segment after the parent by hand: positions and attention are wrong.
    layers = []
    for p_layer, a_layer in zip(chain.artifacts[0].layers, engine.capture(alone)):
        if p_layer.kind == "full":
            import torch

            layers.append(
                kvg.LayerState(
                    "full", torch.cat([p_layer.keys, a_layer.keys], 2), torch.cat([p_layer.values, a_layer.values], 2)
                )
            )
        else:
            layers.append(link.layers[len(layers)])
    wrong = engine.forward(engine.restore(layers), suffix)
    assert tensor_sha256(right) != tensor_sha256(wrong)


def test_recurring_chain_costs_no_prefill(engine, library, chain_store):
    _, hits = library
    with Store(chain_store) as store:
        first = build_chain(store, engine, hits[2:5])
        again = build_chain(store, engine, hits[2:5])
        objects = store.stats()["objects"]
    assert first.prefilled_tokens > 0 and again.prefilled_tokens == 0 and again.new_links == []
    assert again.shas == first.shas
    with Store(chain_store) as store:
        build_chain(store, engine, hits[2:5])
        assert store.stats()["objects"] == objects  # shared links stored once


def test_broken_chains_are_refused(engine, library, chain_store):
    _, hits = library
    with Store(chain_store) as store:
        chain = build_chain(store, engine, hits[:3])
        links = store.load_chain(chain.shas[-1])
    assert [sha for sha, _ in links] == chain.shas
    with pytest.raises(ArtifactError, match="does not continue its chain"):
        check_chain([links[0], links[2]], "test")  # a link skipped
    with pytest.raises(ArtifactError, match="does not continue its chain"):
        check_chain([links[1], links[0]], "test")  # out of order


def test_link_metadata_must_agree(engine, library, chain_store):
    """A link payload whose start position says root but which names a parent is refused by the decoder."""
    _, hits = library
    with Store(chain_store) as store:
        chain = build_chain(store, engine, hits[:2])
    link = chain.artifacts[1]
    meta = {
        k: v
        for k, v in link.meta.items()
        if k
        not in (
            "format",
            "format_version",
            "num_layers",
            "num_tokens",
            "layer_types",
            "sliding_windows",
            "cumulative_lengths",
        )
    }
    meta["start_position"] = "0"
    bad = kvg.encode(link.token_ids, link.layers, meta)
    with pytest.raises(ArtifactError, match="disagree|inconsistent"):
        kvg.decode(bad, "bad")


def test_a_library_row_or_link_key_naming_another_artifact_is_refused(engine, library, chain_store):
    """Which artifact a library row or a link key names is only a label in the index (an edited index, a lying
    remote batch): the artifact grafted must hold exactly what its entry's text renders to."""
    import dataclasses

    from kvgraft_cli.errors import IntegrityError

    _, hits = library
    swapped = dataclasses.replace(hits[0], artifact=hits[1].artifact)  # problem 0's text, problem 1's artifact
    with Store(chain_store) as store:
        with pytest.raises(IntegrityError, match=f"names artifact {hits[1].artifact[:16]}"):
            build_chain(store, engine, [swapped])
        chain = build_chain(store, engine, hits[:2])  # deposits the link (hits[0] -> hits[1])
        key = chain.new_links[0][0]
        store._db.execute("UPDATE entries SET artifact = ? WHERE key = ?", (hits[2].artifact, key))
        with pytest.raises(IntegrityError, match="after its parent"):
            build_chain(store, engine, hits[:2])
