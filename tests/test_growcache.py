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
    assert all(
        l.keys.data_ptr() == l._kbuf.data_ptr() and l.keys.shape[-2] == len(prefix) + len(suffix) + 20 for l in full
    )
    # Keys and values: the first update (the suffix) moves into a buffer with room for 3 more, then every 4th
    # decode step moves again: 1 + 20 / 4 buffers each.
    assert sorted(made) == sorted(
        [len(prefix) + len(suffix) + 3 + 4 * k for k in range(6) for _ in range(2)] * len(full)
    )

    monkeypatch.setenv("KVGRAFT_GROW_IN_PLACE", "0")
    concatenated = engine.restore(art.layers)
    assert not any(isinstance(l, growcache.layer_class()) for l in concatenated.layers)
    fresh, _ = engine.prefill(prefix)
    assert (
        tensor_sha256(grown)
        == tensor_sha256(_decode(engine, concatenated, suffix, 20))
        == tensor_sha256(_decode(engine, fresh, suffix, 20))
    )


def test_the_first_update_copies_the_artifact_and_never_writes_into_it(engine, grafted):
    _, art = grafted
    before = [(l.keys.clone(), l.values.clone()) for l in art.layers if l.kind == "full"]
    cache = engine.restore(art.layers)
    engine.forward(cache, engine.encode(" more"))
    after = [(l.keys, l.values) for l in art.layers if l.kind == "full"]
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(before, after))
    assert all(
        l.keys.data_ptr() != a.data_ptr()
        for l, (a, _) in zip([l for l in cache.layers if isinstance(l, growcache.layer_class())], after)
    )


def test_not_on_cuda_and_off_by_environment(monkeypatch):
    assert growcache.enabled("cpu") and not growcache.enabled("cuda") and not growcache.enabled("cuda:1")
    monkeypatch.setenv("KVGRAFT_GROW_IN_PLACE", "0")
    assert not growcache.enabled("cpu")


@pytest.fixture(scope="module")
def raw_file(tmp_path_factory, engine, grafted):
    """The grafted prefix as a raw .kvg file named each way (sha256, sha256-tree)."""
    prefix, art = grafted
    out = {}
    for scheme in ("sha256", "sha256-tree"):
        payload = kvg.with_scheme(kvg.encode(prefix, art.layers, art.meta), scheme)
        path = tmp_path_factory.mktemp("room") / f"{scheme}.kvg"
        kvg.write_file(path, payload, codec="raw")
        out[scheme] = path, kvg.payload_identity(payload)
    return out


@pytest.mark.parametrize("scheme", ["sha256", "sha256-tree"])
def test_a_graft_read_with_room_grows_into_it_without_a_copy(engine, grafted, raw_file, scheme):
    """open_file(room=R): the same identity and bytes as without room; full layers (only) are views of buffers with
    R more positions; the cache restored from them writes the suffix and decode steps into that room (no copy, no
    move), with logits byte-equal to a fresh prefill and to a graft read without room; the prefix is never written;
    a second cache from the same state copies instead (the room is taken once)."""
    prefix, _ = grafted
    path, sha = raw_file[scheme]
    suffix = engine.encode("\nQuestion: and the first twenty?\nAnswer:")
    _, plain = kvg.open_file(path, sha)
    ident, art = kvg.open_file(path, sha, room=len(suffix) + 8)
    assert ident == sha
    assert [l.room is not None for l in art.layers] == [l.kind == "full" for l in art.layers]
    assert any(l.kind == "full" for l in art.layers) and any(l.kind != "full" for l in art.layers)
    for a, b in zip(plain.layers, art.layers):
        assert a.kind == b.kind and (
            a.keys is None or (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values))
        )
    rooms = [l.room for l in art.layers if l.kind == "full"]
    assert all(
        k.shape[-2] == len(prefix) + len(suffix) + 8 and k.data_ptr() == l.keys.data_ptr()
        for (k, _), l in zip(rooms, [l for l in art.layers if l.kind == "full"])
    )
    before = [(l.keys.clone(), l.values.clone()) for l in art.layers if l.kind == "full"]

    cache = engine.restore(art.layers)
    assert all(l.room is None for l in art.layers)
    grown = _decode(engine, cache, suffix, 8)
    full = [l for l in cache.layers if isinstance(l, growcache.layer_class())]
    assert len(full) == len(rooms)
    assert all(l._kbuf is k and l._vbuf is v and l.keys.data_ptr() == k.data_ptr() for l, (k, v) in zip(full, rooms))
    assert all(l.keys.shape[-2] == len(prefix) + len(suffix) + 8 for l in full)
    assert all(
        torch.equal(a, l.keys) and torch.equal(b, l.values)
        for (a, b), l in zip(before, [l for l in art.layers if l.kind == "full"])
    )

    again = engine.restore(art.layers)  # the room is taken: this cache copies on its first update
    copied = _decode(engine, again, suffix, 8)
    assert all(
        l._kbuf.data_ptr() != k.data_ptr()
        for l, (k, _) in zip([l for l in again.layers if isinstance(l, growcache.layer_class())], rooms)
    )
    fresh, _ = engine.prefill(prefix)
    assert (
        tensor_sha256(grown)
        == tensor_sha256(copied)
        == tensor_sha256(_decode(engine, fresh, suffix, 8))
        == tensor_sha256(_decode(engine, engine.restore(plain.layers), suffix, 8))
    )


@pytest.mark.parametrize("scheme", ["sha256", "sha256-tree"])
def test_a_damaged_file_read_with_room_is_refused_as_without(tmp_path, raw_file, scheme):
    """A flipped byte in a KV tensor, or a file cut short: the same error as the reader without room."""
    path, sha = raw_file[scheme]
    data = bytearray(path.read_bytes())
    data[-5000] ^= 1
    bad = tmp_path / "bad.kvg"
    bad.write_bytes(bytes(data))
    short = tmp_path / "short.kvg"
    short.write_bytes(path.read_bytes()[:-5000])
    from kvgraft_cli.errors import KvgraftError

    for damaged in (bad, short):
        with pytest.raises(KvgraftError) as without:
            kvg.open_file(damaged, sha)
        with pytest.raises(KvgraftError) as with_room:
            kvg.open_file(damaged, sha, room=64)
        assert str(with_room.value) == str(without.value) and type(with_room.value) is type(without.value)


def test_a_chain_is_joined_into_buffers_its_cache_grows_into(engine):
    """restore_chain joins the links' full layers into buffers with room (growcache.with_room) that the cache takes:
    the suffix is written there, and the logits are byte-equal to a fresh prefill of both links."""
    a = engine.prefix_ids("Problem: add the first ten odd numbers.\n")
    b = engine.encode("Solution: 1+3+5+...+19 = 100.\n")
    cache, _ = engine.prefill(a)
    root = kvg.Artifact(a, engine.capture(cache), {})
    cache, _ = engine.prefill(b, cache=cache)  # a link is prefilled on its parent's cache (runs.graft.prefill_chain)
    link = kvg.Artifact(b, engine.capture(cache, start=len(a)), {"start_position": str(len(a))})
    suffix = engine.encode("\nQuestion: and the first twenty?\nAnswer:")
    grafted = engine.restore_chain([root, link])
    got = _decode(engine, grafted, suffix, 4)
    full = [l for l in grafted.layers if isinstance(l, growcache.layer_class())]
    assert full and all(
        l.keys.data_ptr() == l._kbuf.data_ptr() and l._kbuf.shape[-2] == len(a) + len(b) + growcache.SLACK_TOKENS
        for l in full
    )
    fresh, _ = engine.prefill(a)
    fresh, _ = engine.prefill(b, cache=fresh)
    assert tensor_sha256(got) == tensor_sha256(_decode(engine, fresh, suffix, 4))


def test_graft_reads_its_artifact_with_room_on_the_cpu(deposited, engine, monkeypatch):
    """`graft` (runs.graft.open_artifact: from the store, or a .kvg path) reads full layers with the growing cache's
    room, and the graft is the same as one read without it (KVGRAFT_GROW_IN_PLACE=0: no room, concatenation)."""
    from kvgraft_cli.runs.graft import graft_generate, open_artifact
    from kvgraft_cli.store.local import VERIFIED

    ctx, report = deposited
    sha = next(r.artifact for r in report.results if r.artifact)
    VERIFIED.clear()  # an artifact another test remembered is shared, so it is returned as it is: without room
    with ctx.open_store(create=False) as store:
        path = str(store.object_path(sha))
    results = {}
    for ref in (sha, path):
        loaded = open_artifact(ctx, ref)
        assert [l.room is not None for l in loaded.artifact.layers] == [
            l.kind == "full" for l in loaded.artifact.layers
        ]
        n = len(loaded.token_ids)  # room for as many tokens as it holds, at most the growing cache's slack
        assert all(
            l.room[0].shape[-2] == n + min(n, growcache.SLACK_TOKENS)
            for l in loaded.artifact.layers
            if l.room is not None
        )
        results[ref] = graft_generate(ctx, engine, loaded, "What is 2 + 2?", 6).generated_ids
    with ctx.open_store(create=False) as store:
        store.load(sha)  # remembered (as `solve` does): shared from now on, so never read with room
    assert all(l.room is None for l in open_artifact(ctx, sha).artifact.layers)
    VERIFIED.clear()
    monkeypatch.setenv("KVGRAFT_GROW_IN_PLACE", "0")
    loaded = open_artifact(ctx, sha)
    assert all(l.room is None for l in loaded.artifact.layers)
    assert results[sha] == results[path] == graft_generate(ctx, engine, loaded, "What is 2 + 2?", 6).generated_ids


def test_room_that_is_not_the_layers_own_buffer_is_not_taken(engine, grafted):
    """A state whose ``room`` does not hold its keys and values as its first tokens (built by hand, or a copy) is
    restored by copying: the cache never writes into memory it was not shown to own."""
    prefix, art = grafted
    layers = [kvg.LayerState(l.kind, l.keys, l.values, l.sliding_window, l.cumulative_length) for l in art.layers]
    strangers = {}
    for i, l in enumerate(layers):
        if l.kind == "full":
            l.room = strangers[i] = (growcache.with_room([l.keys]), growcache.with_room([l.values]))
    cache = engine.restore(layers)
    engine.forward(cache, engine.encode(" more"))
    for i, (k, v) in strangers.items():
        assert (
            cache.layers[i]._kbuf is not k and not k[..., len(prefix) :, :].any() and not v[..., len(prefix) :, :].any()
        )


def test_states_replaced_after_the_restore_are_copied_not_dropped(engine, raw_file):
    """A cache that took the room, whose keys and values are then replaced (probe re-rotates them before its first
    update): the next update copies the replacements into buffers of its own, never writes past the stale ones."""
    path, sha = raw_file["sha256"]
    _, art = kvg.open_file(path, sha, room=64)
    cache = engine.restore(art.layers)
    layer = next(l for l in cache.layers if isinstance(l, growcache.layer_class()))
    taken = layer._kbuf
    n = layer.keys.shape[-2]
    layer.keys, layer.values = (layer.keys * 2).contiguous(), (layer.values * 3).contiguous()
    replaced = layer.keys.clone(), layer.values.clone()
    new = torch.ones_like(layer.keys[..., :1, :]), torch.ones_like(layer.values[..., :1, :])
    keys, values = layer.update(*new)
    assert torch.equal(keys[..., :n, :], replaced[0]) and torch.equal(values[..., :n, :], replaced[1])
    assert torch.equal(keys[..., n:, :], new[0]) and layer._kbuf is not taken


def test_a_chain_link_is_not_read_with_room(tmp_path, engine):
    """Only a root gets room: a link's layers are joined with its parents' (restore_chain), so room would be unused."""
    a = engine.prefix_ids("Problem: add the first ten odd numbers.\n")
    b = engine.encode("Solution: 1+3+5+...+19 = 100.\n")
    cache, last = engine.prefill(a)
    root = kvg.encode(a, engine.capture(cache), engine.artifact_meta("0" * 64))
    cache, _ = engine.prefill(b, cache=cache)
    link = kvg.encode(
        b,
        engine.capture(cache, start=len(a)),
        engine.artifact_meta("0" * 64, start=len(a), parent=kvg.payload_identity(root)),
    )
    for name, payload in (("root", root), ("link", link)):
        kvg.write_file(tmp_path / f"{name}.kvg", payload, codec="raw")
    _, r = kvg.open_file(tmp_path / "root.kvg", room=64)
    _, l = kvg.open_file(tmp_path / "link.kvg", room=64)
    assert any(s.room is not None for s in r.layers) and all(s.room is None for s in l.layers)


@pytest.mark.parametrize("scheme", ["sha256-tree", "sha256"])  # read by readv, and through the staging buffers
def test_a_file_cut_short_under_the_reader_is_refused_with_room(tmp_path, raw_file, monkeypatch, scheme):
    """The container check saw the whole file, then the head-by-head read meets its end early (the file was cut
    under it): refused as the plain reader refuses it, nothing returned."""
    from kvgraft_cli.artifacts import container
    from kvgraft_cli.errors import IntegrityError

    path, sha = raw_file[scheme]
    full = path.stat().st_size
    cut = tmp_path / "cut.kvg"
    cut.write_bytes(path.read_bytes()[: full - 5000])
    monkeypatch.setattr(container, "file_size", lambda f: full)
    for room in (0, 64):
        with pytest.raises(IntegrityError, match="truncated .kvg container"):
            kvg.open_file(cut, sha, room=room)


def test_a_pool_lends_its_maps_to_one_request_after_another(engine, grafted, monkeypatch):
    """growcache.pooled (kvgraft serve's requests): the second request's cache is built in the maps the first one
    used (no new map), a map still held when the scope ends stays out of the pool, and the logits are byte-equal to
    a cache on fresh maps, also when stale bytes of another request fill the recycled maps."""
    prefix, art = grafted
    suffix = engine.encode("\nQuestion: and the first twenty?\nAnswer:")
    monkeypatch.setattr(growcache, "SLACK_TOKENS", 3)  # 8 decode steps move to other buffers twice
    want = tensor_sha256(_decode(engine, engine.restore(art.layers), suffix, 8))
    pool = growcache.BufferPool()
    count, nbytes = engine.cache_buffers(len(prefix) + len(suffix) + 8)
    pool.reserve(count, nbytes)
    reserved = {id(m) for m in pool.free}
    assert len(reserved) == count and pool.free_bytes >= count * nbytes
    for _ in range(2):
        with growcache.pooled(pool):
            got = tensor_sha256(_decode(engine, engine.restore(art.layers), suffix, 8))
        assert got == want
        assert {id(m) for m in pool.free} == reserved and not pool.lent  # every map back, none new
    for m in pool.free:  # another request's bytes everywhere: nothing past what a cache writes is read
        m[:] = b"\xff" * len(m)
    del m  # (a name on a map holds it: the pool would not lend it back)
    with growcache.pooled(pool):
        kept = engine.restore(art.layers)
        got = tensor_sha256(_decode(engine, kept, suffix, 8))
    assert got == want
    held = {id(l._kbuf.untyped_storage()) for l in kept.layers if isinstance(l, growcache.layer_class())}
    assert held and len(pool.free) < count  # the cache still alive holds its maps: they were not taken back
    del kept
    with growcache.pooled(pool):
        pass
    assert {id(m) for m in pool.free} == reserved and not pool.lent  # let go: back in the pool


@pytest.mark.parametrize("arch", ["llama", "embedded"])
def test_a_servers_slot_is_continued_where_it_holds_the_chunks(engine, tmp_path, arch):
    """kvgraft serve keeps the last request's cache (promptcache.Slot): a prompt that starts with the chunks it holds
    continues it, cut back to them (no join of the chunks again), and computes the logits and decode a restore from
    the store and a cold prompt compute; a prompt that does not start with them restores as before. A model with
    sliding-window layers (the embedded one) is never continued: a window's state cannot be cut back."""
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.engine.zoo import tiny_manifest
    from kvgraft_cli.serve import promptcache
    from kvgraft_cli.store.local import Store

    if arch != "embedded":
        engine = load_engine(tiny_manifest(arch, tmp_path / "zoo"))
    store = Store(tmp_path / "store")
    shared = engine.prefix_ids("Problem: add the first ten odd numbers.\nSolution: 1+3+5+...+19 = 100.\n" * 2)
    first = shared + engine.encode("Question: and the first five?")
    second = shared + engine.encode("Question: and the first twenty, twice over?")
    chunk = 8

    def answer(ids, slot, where):
        pre = promptcache.prefill(engine, where, ids, chunk, slot)
        gen, steps = engine.greedy(pre.cache, pre.last_logits, 6)
        return pre, tensor_sha256(pre.last_logits) + tensor_sha256(steps)

    want = answer(second, None, Store(tmp_path / "cold"))[1]
    pre, _ = answer(first, None, store)  # deposits the chunks; its cache (decoded past the prompt) is the slot
    slot = promptcache.Slot(pre.chain, pre.cache)
    assert len(pre.chain) == len(first) // chunk
    again, got = answer(second, slot, store)
    assert again.from_slot == (arch != "embedded") and again.restored_tokens >= (len(shared) // chunk) * chunk
    assert got == want
    restored, got = answer(second, None, store)
    assert not restored.from_slot and got == want  # (restored from the store: more chunks, the second prompt's own)
    other = promptcache.Slot(["0" * 64] + pre.chain[1:], pre.cache)  # holds other chunks: not continued
    assert not answer(second, other, store)[0].from_slot
    # A slot that holds only the first of the chunks the store has for the prompt: cut back to those, the store's
    # others written after them. Computed cold (another store), as a server's first prompt is: its buffers are the
    # ones forwards grew, inference tensors
    pre, _ = answer(first, None, Store(tmp_path / "other"))
    short = promptcache.Slot(pre.chain[:2], pre.cache)
    partly, got = answer(second, short, store)
    assert partly.from_slot == (arch != "embedded") and partly.restored_tokens > 2 * chunk and got == want


class _ShortReads:
    """A raw file whose reads return at most ``cap`` bytes (the OS may cut any read short), counting them."""

    def __init__(self, f, cap: int, calls: list):
        self.f, self.cap, self.calls = f, cap, calls

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def readinto(self, b):
        self.calls.append(len(b))
        return self.f.readinto(memoryview(b)[: self.cap])

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("scheme", ["sha256-tree", "sha256", "blake3"])
def test_the_batched_read_gives_the_same_artifact_however_the_os_reads(raw_file, tmp_path, monkeypatch, scheme):
    """raw_reader: the pieces filled by readv in batches (a tree identity: a batch cut at a byte limit and at an
    iovec count, a read the OS cuts short anywhere, no readv at all) or through the staging buffers (a one-stream
    identity: chunks smaller than a piece, so each buffer is read into again after its bytes are hashed, reads cut
    short) give the same identity and the same tensors, and a flipped byte is refused either way."""
    import os

    from kvgraft_cli.artifacts import payload as payload_mod
    from kvgraft_cli.artifacts import raw_reader

    path, _ = raw_file["sha256-tree"]
    payload = kvg.with_scheme(kvg.read_file(path)[0], scheme)
    path = tmp_path / f"{scheme}.kvg"
    kvg.write_file(path, payload, codec="raw")
    sha = kvg.payload_identity(payload)
    want = kvg.decode(payload)  # the payload decoded in memory: not the reader under test
    real_readv, real_open = os.readv, payload_mod._open
    calls: list = []

    def short(fd, buffers):  # at most 1,000 bytes a call, cut anywhere: inside a piece, at a piece's end
        calls.append(len(buffers))
        cut = [memoryview(b)[: max(0, 1000 - sum(len(x) for x in buffers[:i]))] for i, b in enumerate(buffers)]
        return real_readv(fd, [c for c in cut if len(c)])

    if scheme == "sha256-tree":
        changes: tuple = (
            {"_READ_BATCH": 3000},  # a few pieces a batch; a piece over it read alone
            {"_IOV": 2},
            {"short": short},
            {"no readv": None},
        )
    else:
        changes = (
            {"_STAGE_MIN": 3000, "_STAGE_MAX": 3000},  # chunks smaller than a piece; both buffers read into again
            {"short reads": lambda p: _ShortReads(real_open(p), 1000, calls)},
            {"_STAGE_MIN": 5000, "_STAGE_MAX": 5000, "short reads": lambda p: _ShortReads(real_open(p), 1700, calls)},
        )
    for change in changes:
        with monkeypatch.context() as m:
            for k, v in change.items():
                if k == "short":
                    m.setattr(os, "readv", v)
                elif k == "no readv":
                    m.delattr(os, "readv")
                elif k == "short reads":
                    m.setattr(payload_mod, "_open", v)
                else:
                    m.setattr(raw_reader, k, v)
            ident, got = kvg.open_file(path, sha, room=8)
        assert ident == sha and got.token_ids == want.token_ids, change
        for a, b in zip(want.layers, got.layers, strict=True):
            assert a.kind == b.kind and (
                a.keys is None or (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values))
            )
    # the short reads were asked for several pieces at once (readv), or for whole chunks (staged)
    assert calls and max(calls) > (1 if scheme == "sha256-tree" else 1000)
    bad = bytearray(path.read_bytes())
    bad[-100] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(bad))
    from kvgraft_cli.errors import IntegrityError

    for stage in (3000, 1 << 20):
        with monkeypatch.context() as m, pytest.raises(IntegrityError, match="does not match its identity"):
            m.setattr(raw_reader, "_STAGE_MIN", stage)
            m.setattr(raw_reader, "_STAGE_MAX", stage)
            kvg.open_file(path, sha, room=8)


def test_a_graft_read_into_a_pools_stale_maps_is_exact(engine, grafted, raw_file):
    """Inside growcache.pooled a graft's read takes the pool's maps (recycled, full of another request's bytes): the
    layers are read into them, and the graft's logits and decode are byte-equal to a read into fresh maps."""
    prefix, _ = grafted
    path, sha = raw_file["sha256-tree"]
    suffix = engine.encode("\nQuestion: and the first twenty?\nAnswer:")
    want = tensor_sha256(_decode(engine, engine.restore(kvg.open_file(path, sha, room=8)[1].layers), suffix, 8))
    pool = growcache.BufferPool()
    pool.reserve(*engine.cache_buffers(len(prefix) + len(suffix) + 8))
    for m in pool.free:
        m[:] = b"\xff" * len(m)
    del m
    reserved = {id(m) for m in pool.free}
    with growcache.pooled(pool):
        art = kvg.open_file(path, sha, room=8)[1]
        lent = {id(m) for m in pool.lent}
        got = tensor_sha256(_decode(engine, engine.restore(art.layers), suffix, 8))
        del art
    assert lent and lent <= reserved  # the read's buffers were the pool's
    assert got == want
