"""Benchmark: forwards over a grafted cache under transformers' eager attention and under kvgraft's ``grouped``
kernel (engine.attention: the same arithmetic without copying every KV head once per query head), side by side.

A random-weight model of SmolLM-135M's shape (bench_graft.py's config: 9 query heads over 3 KV heads) is drawn by
engine.randommodel under the native profile. For each dtype and cache length a cache of that many tokens is
restored from random KV states (what the keys and values hold does not change the time), then the 16-token query's
forward and --steps decode steps run on it, eager and grouped interleaved --repeat times (medians). Printed per row:
query forward and decode step times under each and their ratio, and the peak RSS that the query and the decode
steps add above the restored cache, each measured in a fresh process (the cache restored as `kvgraft graft` restores
it, into buffers with room: its first step copies nothing). Each implementation's logits must be the
same bytes in every repeat (``same bits``). Its greedy tokens are compared with eager's for information only:
the two kernels' bits differ. Usage:

    python benchmarks/bench_attention.py [--tokens 2048 8192] [--dtypes float32 bfloat16] [--repeat 5] [--steps 16]
                                         [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
IMPLS = ("eager", "grouped")
QUERY = list(range(100, 116))
_WORKDIR = tempfile.TemporaryDirectory()  # the drawn models' config and manifest, removed when the process ends


def _engine(dtype: str, smoke: bool = False):
    """The SmolLM-135M-shaped model under the native profile, with the grouped kernel registered (``smoke``: its
    2-layer miniature, bench_graft._smoke_config)."""
    from kvgraft_cli.engine.determinism import pin_profile

    pin_profile("native", "cpu")
    from bench_graft import _smoke_config, _smol_config

    from kvgraft_cli.engine.attention import register
    from kvgraft_cli.engine.randommodel import random_engine

    register()
    config = _smoke_config() if smoke else _smol_config()
    return random_engine("smol", config, Path(_WORKDIR.name) / dtype, device="cpu", dtype=dtype, profile="native")


def _states(eng, tokens: int, room: bool = False):
    """Random full-layer KV states of ``tokens`` tokens for every layer of ``eng``'s model; with ``room`` in
    buffers the cache grows into, as `kvgraft graft` reads an artifact (growcache), so its first step copies none."""
    import torch

    from kvgraft_cli.artifacts.format import LayerState
    from kvgraft_cli.engine.growcache import with_room

    cfg = eng.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (1, cfg.num_key_value_heads, tokens, head_dim)
    g = torch.Generator().manual_seed(tokens)
    dt = eng.model.dtype
    states = []
    for _ in range(cfg.num_hidden_layers):
        k, v = torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt)
        if room:
            kb, vb = with_room([k]), with_room([v])
            states.append(LayerState("full", kb[..., :tokens, :], vb[..., :tokens, :], room=(kb, vb)))
        else:
            states.append(LayerState("full", k, v))
    return states


def _run(eng, states, impl: str, steps: int):
    """Restore, query forward, ``steps`` greedy steps under ``impl``: (query s, median step s, logits SHA, tokens)."""
    from kvgraft_cli.engine.engine import tensor_sha256

    eng.model.set_attn_implementation(impl)
    cache = eng.restore(states)
    t0 = time.perf_counter()
    logits = eng.forward(cache, QUERY)
    t_query = time.perf_counter() - t0
    laps, tokens, hashes = [], [], [tensor_sha256(logits)]
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        t0 = time.perf_counter()
        logits = eng.forward(cache, tokens[-1:])
        laps.append(time.perf_counter() - t0)
        hashes.append(tensor_sha256(logits))
    return t_query, statistics.median(laps), "".join(hashes), tokens


def _rss_child(impl: str, dtype: str, tokens: int, steps: int) -> None:
    """In a fresh process: restore, reset the peak mark, query + decode under ``impl``; print the peak's rise."""
    print(json.dumps({"rise": _rss_rise(_engine(dtype), impl, tokens, steps)}))


def _rss_rise(eng, impl: str, tokens: int, steps: int) -> int:
    """Restore ``tokens`` random tokens with room, reset the peak mark, query + decode under ``impl``: the bytes the
    peak RSS rose (a fresh process's, in the table; --smoke measures in its own)."""
    states = _states(eng, tokens, room=True)

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    eng.model.set_attn_implementation(impl)
    cache = eng.restore(states)
    del states
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    logits = eng.forward(cache, QUERY)
    for _ in range(steps):
        logits = eng.forward(cache, [int(logits[-1].argmax())])
    return status("VmHWM") - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run end to end (tests/test_benchmarks.py): the model's 2-layer miniature, 16 tokens, "
        "float32, one repeat, one decode step, the peak RSS measured in this process",
    )
    ap.add_argument("--rss-child", nargs=3, help=argparse.SUPPRESS)  # IMPL DTYPE TOKENS
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.dtypes, args.repeat, args.steps = [16], ["float32"], 1, 1
    if args.rss_child:
        impl, dtype, tokens = args.rss_child
        _rss_child(impl, dtype, int(tokens), args.steps)
        return

    rows = []
    for dtype in args.dtypes:
        eng = None
        for n in args.tokens:
            rss = {}
            for impl in IMPLS:  # fresh processes first, while this one holds no model
                if args.smoke:
                    eng = eng or _engine(dtype, smoke=True)
                    rss[impl] = _rss_rise(eng, impl, n, args.steps)
                    continue
                out = subprocess.run(
                    [sys.executable, __file__, "--rss-child", impl, dtype, str(n), "--steps", str(args.steps)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                rss[impl] = json.loads(out.strip().splitlines()[-1])["rise"]
            eng = eng or _engine(dtype, smoke=args.smoke)
            states = _states(eng, n)
            payload = sum(s.keys.nbytes + s.values.nbytes for s in states)
            got: dict[str, list] = {impl: [] for impl in IMPLS}
            for _ in range(args.repeat):
                for impl in IMPLS:
                    got[impl].append(_run(eng, states, impl, args.steps))
            med = {
                impl: (statistics.median(r[0] for r in got[impl]), statistics.median(r[1] for r in got[impl]))
                for impl in IMPLS
            }
            same = all(len({r[2] for r in got[impl]}) == 1 for impl in IMPLS)
            agree = got["eager"][0][3] == got["grouped"][0][3]
            rows.append((dtype, n, payload, med, rss, same, agree))
        del eng
    layers = "2 layers (--smoke)" if args.smoke else "30 layers"
    print(
        f"SmolLM-135M shape (9 query heads over 3 KV heads, {layers}), native profile, query {len(QUERY)} tokens, "
        f"{args.steps} decode steps, medians of {args.repeat}"
    )
    print(
        f"{'dtype, cache':18} {'KV MB':>7} {'query eager':>12} {'grouped':>8} {'ratio':>6} {'step eager':>11} "
        f"{'grouped':>8} {'ratio':>6} {'peak +MB eager':>15} {'grouped':>8}  same bits  same tokens"
    )
    for dtype, n, payload, med, rss, same, agree in rows:
        (qe, se), (qg, sg) = med["eager"], med["grouped"]
        print(
            f"{dtype + ', ' + str(n):18} {payload / 1e6:>7.1f} {qe:>11.3f}s {qg:>7.3f}s {qe / qg:>5.2f}x "
            f"{se:>10.4f}s {sg:>7.4f}s {se / sg:>5.2f}x {rss['eager'] / 1e6:>15.1f} {rss['grouped'] / 1e6:>8.1f}  "
            f"{str(same):9}  {agree}"
        )


if __name__ == "__main__":
    main()
