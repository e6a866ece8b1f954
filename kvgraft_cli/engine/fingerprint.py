"""The kernels' empirical fingerprint: the logits of a fixed short forward, hashed, once a process.

A kernel identity (config.kernels) names the kernels a manifest leaves to the machine, by the CPU that picks them;
under pinned kernels (``portable``, ``avx2``) the manifest names them. Either is a claim about which code runs. The
fingerprint is what that code computed: a forward of PROBE_TOKENS tokens on a fresh cache and one decode step after
them, under the manifest (its schedule, its forward), their logits hashed. Two processes whose kernels compute the
same bits for this model give the same fingerprint; one that differs shows that its kernels do, whatever the pins
say. Ledger lines carry it (``environment.kernels.probe``), so `kvgraft replay` can tell a machine whose kernels
compute other bits from a run that went wrong.
"""

from __future__ import annotations

import hashlib
from typing import Any

PROBE_TOKENS = 8


def probe_ids(vocab: int) -> list[int]:
    """The fixed token ids of the probe: spread over the vocabulary, the same for every model of one vocabulary."""
    return [(1 + 7919 * i) % vocab for i in range(PROBE_TOKENS + 1)]


def fingerprint(engine: Any) -> str:
    """SHA-256 of the probe's logits bytes (the prefill's last position, then one decode step), under ``engine``'s
    manifest, on a fresh cache."""
    import torch

    ids = probe_ids(int(engine.model.config.get_text_config().vocab_size))
    cache, first = engine.prefill(ids[:-1])
    step = engine.forward(cache, ids[-1:], last_only=True)[-1]
    h = hashlib.sha256()
    for t in (first, step):  # raw bytes, any dtype (numpy has no bfloat16: read them as bytes)
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def kernels_record(engine: Any) -> dict[str, Any]:
    """What a ledger line records of the kernels: the manifest's kernel identity here (None under pinned kernels),
    the capability ATen dispatches to, the CPU, and the fingerprint."""
    import os

    from ..config.kernels import CPUINFO_ENV, this_cpu
    from .determinism import aten_capability

    cpu = this_cpu()
    return {
        "identity": engine.manifest.kernels,
        "aten": aten_capability().lower(),
        "cpu": cpu.model,
        "isa": " ".join(cpu.isa),
        "probe": fingerprint(engine),
        **({"cpuinfo": os.environ[CPUINFO_ENV]} if os.environ.get(CPUINFO_ENV) else {}),
    }
