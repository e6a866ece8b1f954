"""The exactness matrix: architecture x dtype x profile, each cell N samples of graft against fresh computation.

A sample is a random prefix (some longer than the sliding windows) and a random suffix. The prefix is prefilled,
captured, encoded to ``.kvg`` bytes and decoded again (the on-disk path), restored into a fresh cache, then the
suffix and a few greedy steps run on it; the same runs on a freshly prefilled cache. A sample counts as SHA-equal
when the two logits tensors have the same SHA-256 (equal bytes). KL is computed in float64.

With ``single_pass`` the fresh side is instead one forward over prefix+suffix from position 0 (what a user gets by
simply running the model on the whole prompt): under the ``invariant`` schedule that must be byte-equal too; under
``single`` it is not (the single-pass difference the graft check reports), and the matrix says so.

A cell's ``fingerprint`` is the SHA-256 over its fresh logits hashes: the number a second machine must reproduce
for the profile to be called portable (see tests/test_portable.py and scripts/portability.py).

Kernel flags are read when torch is imported, so one process runs one profile: :func:`run_profile` pins the
profile's environment first and refuses if torch was already imported with other values. :func:`run_matrix` runs
each profile in its own worker process (runs.workers.local), which returns the cells as structured records.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..artifacts import format as kvg
from ..config.profiles import DTYPES, PROFILES
from ..engine import determinism
from ..engine.engine import Engine, load_engine, tensor_sha256
from ..engine.zoo import ARCHS, tiny_manifest
from ..errors import InputError, UnsupportedModel, engine_not_installed
from ..util.hashing import sha256_bytes
from .graft import compare_logits

# Runtime errors that mean "this backend/dtype cannot run this model here", not "kvgraft is wrong".
_UNSUPPORTED_MESSAGES = (
    "not implemented for",
    "does not have a deterministic implementation",
    "No available kernel",
    "not supported",
)
DECODE_STEPS = 4
_ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?()+-*/=\n"


@dataclass
class Cell:
    """One architecture x dtype x profile (x device, attention) cell."""

    arch: str
    dtype: str
    profile: str
    device: str
    attn: str
    samples: int = 0
    sha_equal: int = 0
    max_kl: float = 0.0
    argmax_agreement: float = 1.0  # lowest share of positions with equal argmax over samples
    fingerprint: str = ""  # SHA-256 over the per-sample fresh logits hashes
    unsupported: str | None = None  # the reason, when the cell cannot run here
    seconds: float = 0.0
    schedule: str = "single"  # the manifests' prefill schedule
    single_pass: bool = False  # the fresh side is one forward over prefix+suffix

    @property
    def exact(self) -> bool:
        return self.unsupported is None and self.samples > 0 and self.sha_equal == self.samples and self.max_kl == 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "exact": self.exact}

    @classmethod
    def from_json(cls, d: dict) -> Cell:
        """The cell a worker reported (``exact`` is derived, never read back)."""
        return cls(**{k: v for k, v in d.items() if k != "exact"})


def sample_text(seed: int, i: int, what: str, lo: int, hi: int) -> str:
    """A random text of lo..hi characters, the same for a (seed, i, what) on every machine."""
    rng = random.Random(f"kvgraft-matrix:{seed}:{i}:{what}")
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(lo, hi)))


def run_cell(engine: Engine, cell: Cell, samples: int, seed: int = 0, prefix_chars: tuple[int, int] = (1, 96)) -> Cell:
    """Fill ``cell`` with ``samples`` graft-vs-fresh comparisons on ``engine`` (fresh: the manifest's schedule, or
    with ``cell.single_pass`` one forward over prefix+suffix). Prefixes are ``prefix_chars`` characters long (the
    zoo's sliding windows are 16-32 tokens; a real model's need longer prefixes to be crossed)."""
    import torch

    t0 = time.perf_counter()
    fresh_hashes = []
    for i in range(samples):
        prefix = engine.prefix_ids(sample_text(seed, i, "prefix", *prefix_chars))
        suffix = engine.encode(sample_text(seed, i, "suffix", 1, 24))
        # The deposit's own prefill is a fresh computation: encoding only reads it, so it serves as the fresh side.
        fresh, last = engine.prefill(prefix)
        payload = kvg.encode(prefix, engine.capture(fresh), engine.artifact_meta(tensor_sha256(last)))
        grafted = engine.restore(kvg.decode(payload).layers)
        runs = []
        for c in (fresh, grafted):
            if c is fresh and cell.single_pass:
                c = engine.new_cache()
                logits = engine.forward(c, prefix + suffix)[-len(suffix) :]
            else:
                logits = engine.forward(c, suffix)
            _, steps = engine.greedy(c, logits[-1], DECODE_STEPS)
            runs.append(torch.cat([logits, steps]))
        want, got = runs
        h_want, h_got = tensor_sha256(want), tensor_sha256(got)
        kl, agree = compare_logits(want, got)
        cell.samples += 1
        cell.sha_equal += int(h_want == h_got)  # bytes: torch.equal calls NaN unequal and -0.0 equal to 0.0
        cell.max_kl = max(cell.max_kl, kl)
        cell.argmax_agreement = min(cell.argmax_agreement, agree)
        fresh_hashes.append(h_want)
    cell.fingerprint = sha256_bytes("\n".join(fresh_hashes).encode())
    cell.seconds = round(time.perf_counter() - t0, 3)
    return cell


MATRIX_SCHEDULES = ("single", "invariant")  # chunked needs a chunk size; the matrix compares whole prefixes


def check_selection(archs: list[str], dtypes: list[str], profiles: list[str], schedule: str = "single") -> None:
    """Refuse unknown architectures, dtypes, profiles and schedules by name (before any model is built)."""
    bad = (
        [a for a in archs if a not in ARCHS]
        + [d for d in dtypes if d not in DTYPES]
        + [p for p in profiles if p not in PROFILES]
    )
    if bad:
        raise InputError(
            f"unknown architecture, dtype or profile: {', '.join(bad)}",
            f"architectures: {', '.join(ARCHS)}; dtypes: {', '.join(DTYPES)}; profiles: {', '.join(PROFILES)}",
        )
    if schedule not in MATRIX_SCHEDULES:
        raise InputError(f"unknown matrix schedule {schedule!r}", f"choose one of {', '.join(MATRIX_SCHEDULES)}")


def run_profile(
    profile: str,
    workdir: Path,
    archs: list[str],
    dtypes: list[str],
    samples: int,
    *,
    device: str = "cpu",
    attn: str = "eager",
    sdpa_backend: str | None = None,
    threads: int | None = None,
    schedule: str = "single",
    single_pass: bool = False,
    on_cell=None,
) -> list[Cell]:
    """Every arch x dtype cell under one profile, in this process. Pins the profile's environment first."""
    check_selection(archs, dtypes, [profile], schedule)
    determinism.pin_profile(profile, device)  # torch imported earlier with other flags: refuse, never mislabel
    try:
        import torch  # noqa: F401  (after the pins, on purpose)
        import transformers  # noqa: F401
    except ImportError as e:
        raise engine_not_installed(e) from None
    workdir.mkdir(parents=True, exist_ok=True)
    cells = []
    for arch in archs:
        for dtype in dtypes:
            cell = Cell(
                arch,
                dtype,
                profile,
                device,
                attn if attn != "sdpa" else f"sdpa-{sdpa_backend or 'math'}",
                schedule=schedule,
                single_pass=single_pass,
            )
            try:
                manifest = tiny_manifest(
                    arch,
                    workdir,
                    dtype=dtype,
                    profile=profile,
                    device=device,
                    attn_implementation=attn,
                    threads=threads,
                    sdpa_backend=sdpa_backend,
                    schedule=schedule,
                )
                try:
                    engine = load_engine(manifest)
                except ValueError as e:  # transformers refuses this attention implementation for the architecture
                    raise UnsupportedModel(str(e).split(". ")[0]) from None
                run_cell(engine, cell, samples)
            except (UnsupportedModel, NotImplementedError, RuntimeError) as e:
                # Honest marking, never a silent pass: the cell shows the reason. Only refusals count as
                # unsupported; any other runtime error (a shape bug, out of memory) stops the matrix loudly.
                if isinstance(e, RuntimeError) and not any(m in str(e) for m in _UNSUPPORTED_MESSAGES):
                    raise
                cell.unsupported = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            cells.append(cell)
            if on_cell:
                on_cell(cell)
    return cells


def markdown_table(cells: list[Cell]) -> str:
    """A GitHub table: one row per architecture, one column per dtype x profile (x device/attention)."""
    cols: list[tuple] = []
    for c in cells:
        key = (c.dtype, c.profile, c.device, c.attn)
        if key not in cols:
            cols.append(key)
    vary_dev = len({k[2] for k in cols}) > 1
    vary_attn = len({k[3] for k in cols}) > 1

    def head(k):
        parts = [k[0], k[1]] + ([k[2]] if vary_dev else []) + ([k[3]] if vary_attn else [])
        return " ".join(parts)

    by = {(c.arch, c.dtype, c.profile, c.device, c.attn): c for c in cells}
    archs = list(dict.fromkeys(c.arch for c in cells))
    lines = ["| architecture | " + " | ".join(head(k) for k in cols) + " |", "|---|" + "---|" * len(cols)]
    for a in archs:
        row = []
        for k in cols:
            found = by.get((a, *k))
            row.append("" if found is None else describe(found))
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def describe(c: Cell) -> str:
    """``50/50, KL 0.0, 100%`` (or the reason the cell is unsupported)."""
    if c.unsupported:
        return f"unsupported: {c.unsupported}"
    return f"{c.sha_equal}/{c.samples}, KL {c.max_kl:.3g}, {100 * c.argmax_agreement:.0f}%"


def profile_job(
    profile: str,
    workdir: str,
    archs: list[str],
    dtypes: list[str],
    samples: int,
    device: str,
    attn: str,
    sdpa_backend: str | None,
    threads: int | None,
    emit,
    schedule: str = "single",
    single_pass: bool = False,
) -> None:
    """The worker job behind :func:`run_matrix`: one profile's cells, each emitted as a record when done."""
    run_profile(
        profile,
        Path(workdir),
        archs,
        dtypes,
        samples,
        device=device,
        attn=attn,
        sdpa_backend=sdpa_backend,
        threads=threads,
        schedule=schedule,
        single_pass=single_pass,
        on_cell=lambda c: emit(c.to_json()),
    )


def run_matrix(
    archs: list[str],
    dtypes: list[str],
    profiles: list[str],
    samples: int,
    *,
    device: str = "cpu",
    attn: str = "eager",
    sdpa_backend: str | None = None,
    threads: int | None = None,
    workdir: Path | None = None,
    schedule: str = "single",
    single_pass: bool = False,
    on_cell=None,
) -> list[Cell]:
    """Every arch x dtype x profile cell, each profile in a fresh worker process (its own kernel flags)."""
    import tempfile

    from .workers.local import run_job

    check_selection(archs, dtypes, profiles, schedule)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="kvgraft-matrix-") as tmp:
        base = Path(workdir) if workdir is not None else Path(tmp)
        for prof in profiles:

            def arrived(record: dict) -> None:
                cells.append(Cell.from_json(record))
                if on_cell:
                    on_cell(cells[-1])

            run_job(
                "matrix-profile",
                {
                    "profile": prof,
                    "workdir": str(base / prof),
                    "archs": archs,
                    "dtypes": dtypes,
                    "samples": samples,
                    "device": device,
                    "attn": attn,
                    "sdpa_backend": sdpa_backend,
                    "threads": threads,
                    "schedule": schedule,
                    "single_pass": single_pass,
                },
                arrived,
                where=f"matrix worker for profile {prof}",
            )
    return cells
