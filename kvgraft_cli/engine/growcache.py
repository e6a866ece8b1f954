"""A full-attention cache layer that grows in place, for grafts on the CPU (issue #10: a graft's memory).

transformers' ``DynamicLayer`` concatenates the whole layer into new tensors at every step, each a little larger than
the one it frees: glibc cannot reuse the freed blocks for the next, larger ones, so a graft's memory grew well past its
cache's own size (docs/PERFORMANCE.md, "A graft's memory": the "concatenated at every step" column). ``GrowingLayer``
keeps keys and values in buffers with room for ``SLACK_TOKENS`` more tokens, writes each step's states into place, and
hands attention views of the filled part; when the room is used up it moves to buffers with room again (one copy per
``SLACK_TOKENS`` tokens). Buffers are anonymous memory maps: zero pages from the OS, so the room not yet written costs
no resident memory (torch.empty would fill them first under deterministic algorithms, and a bytearray is zeroed by a
write of every byte), and a buffer given up goes straight back to the OS instead of into the heap.

Exactness: the views hold the same values as the concatenated tensors, but with another stride; attention over them
gives the same logits bits on the CPU: every graft-vs-fresh comparison of the test suite (whose fresh side keeps
``DynamicLayer``; tests/test_architectures.py runs every zoo architecture, eager) and tests/test_growcache.py; a
one-off script (not committed) also found 5 architectures equal under SDPA. On CUDA a kernel's
choice may depend on strides and alignment, so grafts there keep ``DynamicLayer`` until that is measured.
``KVGRAFT_GROW_IN_PLACE=0`` turns it off (for comparisons).

A graft's own read goes further (runs.graft.open_artifact; format.open_file's ``room``): full layers are read from
the file straight into buffers with room, which the cache takes (engine.restore), so not even the first step copies;
a chain's links are joined into such buffers (:func:`with_room`). An artifact the verified LRU shares is never read
with room: the LRU would keep the room, and what the first cache wrote there, alive while counting only the kept
tokens.

Growing in place after a copy lowered a graft's peak above the model, most at long caches; at short ones the first
step's copy of every layer still set the peak, and reading with room removes that copy (bench_restore.py's peak RSS
rows; docs/PERFORMANCE.md, "Restore speed", "A graft's memory").
"""

from __future__ import annotations

import os

# The pool of cache buffers lives with the memory helpers (an artifact's read fills it too); named here as before.
from ..util.memory import BufferPool, cache_memory, pooled  # noqa: F401

SLACK_TOKENS = 256


def enabled(device) -> bool:
    """Whether a graft on ``device`` uses GrowingLayer (the CPU, unless KVGRAFT_GROW_IN_PLACE=0)."""
    return str(device).split(":")[0] == "cpu" and os.environ.get("KVGRAFT_GROW_IN_PLACE", "1") != "0"


def room_for(device) -> int:
    """Tokens of room to read a graft's full layers with on ``device`` (format.open_file's ``room``): the slack
    where the cache grows in place, so it takes the artifact's buffers instead of copying them; else none."""
    return SLACK_TOKENS if enabled(device) else 0


def take_room(layer, room) -> None:
    """Hand a GrowingLayer the (keys, values) buffers it may grow into. Its update writes there only while its keys
    and values are those buffers' first tokens (:func:`holds`), and copies otherwise."""
    layer._kbuf, layer._vbuf = room


def _zeroed(like, tokens: int):
    """A tensor shaped like ``like`` with ``tokens`` positions, on an anonymous map (util.memory.zeroed: no fill, no
    resident memory until written; unmapped when the tensor is freed). Inside :func:`pooled`, a map the pool
    recycled instead (no page faults; its bytes past what the cache writes are stale, and nothing reads them)."""
    import torch

    shape = list(like.shape)
    shape[-2] = tokens
    n = like.element_size()
    for d in shape:
        n *= d
    if not n:
        return torch.empty(shape, dtype=like.dtype)
    return torch.frombuffer(cache_memory(n), dtype=torch.uint8, count=n).view(like.dtype).view(shape)


def cut_back(cache, tokens: int) -> bool:
    """Cut every layer of ``cache`` back to its first ``tokens`` positions in place (the buffers keep their bytes,
    the next update writes after them), when every layer is a GrowingLayer holding at least that many in buffers of
    its own; else change nothing and return False. A sliding window's state cannot be cut back."""
    grow = layer_class()
    layers = cache.layers
    if not all(
        type(layer) is grow
        and getattr(layer, "_kbuf", None) is not None
        and holds(layer.keys, layer._kbuf)
        and holds(layer.values, layer._vbuf)
        and layer.keys.shape[-2] >= tokens
        for layer in layers
    ):
        return False
    for layer in layers:
        layer.keys, layer.values = layer._kbuf[..., :tokens, :], layer._vbuf[..., :tokens, :]
    return True


def holds(kept, buf) -> bool:
    """Whether ``kept`` is ``buf``'s first tokens (so the room past them is ``buf``'s, and a cache may grow there)."""
    return (
        kept.data_ptr() == buf.data_ptr()
        and kept.stride() == buf.stride()
        and kept.dtype == buf.dtype
        and kept.shape[:-2] == buf.shape[:-2]
        and kept.shape[-1] == buf.shape[-1]
        and kept.shape[-2] <= buf.shape[-2]
    )


def with_room(parts: list):
    """The tensors of ``parts`` joined along the token axis into a buffer with room for SLACK_TOKENS more (a
    chain's links, merged for one cache)."""
    import torch

    total = sum(p.shape[-2] for p in parts)
    buf = _zeroed(parts[0], total + SLACK_TOKENS)
    # One call, not one copy a link (docs/PERFORMANCE.md, "A graft's memory").
    torch.cat(parts, dim=-2, out=buf[..., :total, :])
    return buf


def layer_class():
    """The GrowingLayer class: a DynamicLayer whose keys and values are views of buffers it grows in place (see the
    module doc). A layer given a ``kv_dtype`` attribute (model.kv_dtype: engine.new_cache and engine.restore set it)
    keeps its buffers at that width and rounds every state written into them to it. It never writes into tensors it was given (an artifact's, maybe shared with the verified cache): the
    first update copies them into buffers of its own, unless engine.restore handed it buffers with room (a graft's
    own read), which it writes into past the kept tokens. Keys or values replaced after that (probe re-rotates
    them) are copied again. Built on first use, so importing this module imports no transformers."""
    global _CLASS
    if _CLASS is None:
        from transformers.cache_utils import DynamicLayer

        _CLASS = type("GrowingLayer", (DynamicLayer,), {"update": _update, "__doc__": layer_class.__doc__})
    return _CLASS


_CLASS: type | None = None


def _update(self, key_states, value_states, *args, **kwargs):
    """Write the new states into place (moving to buffers with room first when there is none); return views."""
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
    have = self.keys.shape[-2] if self.keys.numel() else 0
    need = have + key_states.shape[-2]
    kbuf = getattr(self, "_kbuf", None)
    if kbuf is not None and not (holds(self.keys, kbuf) and holds(self.values, self._vbuf)):
        kbuf = None  # the layer's states were replaced (probe's re-rotation): its buffers no longer hold them
    if kbuf is None or kbuf.shape[-2] < need:
        narrow = getattr(self, "kv_dtype", None)  # a 16-bit cache (model.kv_dtype): buffers at its width
        if narrow is not None:
            key_states, value_states = key_states.to(narrow), value_states.to(narrow)
        kbuf, vbuf = _zeroed(key_states, need + SLACK_TOKENS), _zeroed(value_states, need + SLACK_TOKENS)
        if have:
            kbuf[..., :have, :] = self.keys
            vbuf[..., :have, :] = self.values
        # Dropping the old tensors here frees them (an artifact's, once the cache alone holds them) before the next
        # layer's buffers are made: one layer in flight, never a second copy of the whole cache.
        self._kbuf, self._vbuf = kbuf, vbuf
    # Into the buffer's dtype: a 16-bit cache rounds each new state to nearest-even here, once, the way every path
    # to the cache does (a fresh prefill, a decode step, a graft's suffix).
    self._kbuf[..., have:need, :] = key_states
    self._vbuf[..., have:need, :] = value_states
    self.keys, self.values = self._kbuf[..., :need, :], self._vbuf[..., :need, :]
    return self.keys, self.values
