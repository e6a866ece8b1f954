"""Greedy decoding, one sequence or several in one step: :class:`Stream` is a sequence's decode (its cache, the ids
chosen so far, when it stops), :func:`step` computes the next forward of every stream not yet done.

A stream's tokens are chosen, and its stops decided, by the same code whether it decodes alone (Engine.greedy) or
beside others (kvgraft serve's and kvgraft solve's continuous batching): a step of several streams differs only in
how the forward is computed, and :meth:`LeanLlama.step <kvgraft_cli.engine.lean.LeanLlama.step>` computes each row's
bits as the stream's forward alone would (checked on the machine before the first batched step:
Engine.batch_refusal). Where that check fails, or the engine has no batched step, the streams of a step are computed
one after another, with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Continuous batching's cap on the rows of a decode step by default (kvgraft serve and solve --batch). Measured by
# benchmarks/bench_batch.py (docs/PERFORMANCE.md, "Batched decode"): the int4 kernel's cost a row stops falling there.
DEFAULT_BATCH = 8


@dataclass
class Stream:
    """One greedy decode of up to ``budget`` tokens on ``cache``, started with :meth:`feed` of the prompt's last
    logits. It stops at EOS (``eos``, when not None), once the text decoded by ``text`` contains one of ``stop``, when
    ``on_token`` (shown the ids so far after each token) returns True, or at the budget. ``keep_logits``: the logits
    of each forward after a token are kept (Engine.greedy's steps), and a stream stopped by its budget still runs the
    forward of its last token (greedy always has); without it that forward, whose logits nobody reads, is skipped."""

    cache: Any
    budget: int
    eos: int | None = None
    stop: list[str] = field(default_factory=list)
    text: Callable[[list[int]], str] | None = None
    on_token: Callable[[list[int]], bool] | None = None
    keep_logits: bool = False
    ids: list[int] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)  # each forward's after a chosen token (keep_logits)
    done: bool = False
    _fed: bool = False

    def __post_init__(self) -> None:
        # A stop string first appears at the end of the output, so only the last tokens need decoding (every token
        # decodes to at least part of a character; the margin covers multi-byte characters split across tokens):
        # the check costs the same at token 30,000 as at token 3.
        self._tail = 4 * max((len(s) for s in self.stop), default=0) + 8
        if self.budget <= 0:
            self.done = True

    def feed(self, logits) -> None:
        """The logits [vocab] of the forward after the last token (first: the prompt's last position's): choose the
        next token, or stop."""
        import torch

        if self._fed and self.keep_logits:
            self.logits.append(logits)
        self._fed = True
        if len(self.ids) >= self.budget:
            self.done = True
            return
        nxt = int(torch.argmax(logits).item())
        self.ids.append(nxt)
        if (
            (self.eos is not None and nxt == self.eos)
            or (self.stop and self.text is not None and any(s in self.text(self.ids[-self._tail :]) for s in self.stop))
            or (self.on_token is not None and self.on_token(self.ids))
            or (len(self.ids) >= self.budget and not self.keep_logits)
        ):
            self.done = True

    @property
    def next_id(self) -> int:
        """The token the next forward computes (the last chosen)."""
        return self.ids[-1]


def step(engine, streams: list[Stream], batch: int = 1) -> int:
    """One forward for every stream not yet done, in steps of at most ``batch`` rows where the engine decodes
    several sequences at once (Engine.batch_refusal is None), else one at a time; each stream is fed its logits.
    Returns the number of streams computed."""
    live = [s for s in streams if not s.done]
    if batch > 1 and len(live) > 1 and engine.batch_refusal is None:
        with engine._infer():
            for i in range(0, len(live), batch):
                part = live[i : i + batch]
                rows = engine.lean.step([s.cache for s in part], [s.next_id for s in part])
                for j, s in enumerate(part):
                    s.feed(rows[j])
    else:
        for s in live:
            s.feed(engine.forward(s.cache, [s.next_id])[-1])
    return len(live)
