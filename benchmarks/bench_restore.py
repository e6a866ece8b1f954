"""Benchmark: how fast a graft restores a deposited KV cache, stage by stage, against what the hardware allows.

Builds a random-weight model from a config (no download; SmolLM-135M's shape by default, as bench_graft.py does),
prefills a random prefix, deposits it in each codec and each identity scheme (--identities: the same cache named by
its plain SHA-256 and by its sha256-tree, docs/FORMAT.md), and prints for every (dtype, tokens), as medians of --repeat
runs measured side by side in this one process:

  restore      the whole graft restore: kvg.open_file (read, decode the codec, re-hash against the identity,
               parse) then engine.restore (fill the model's cache); also read with room, as `kvgraft graft` reads
               (runs.graft.open_artifact: full layers in buffers the cache grows into); a second restore of the
               same artifact in one process comes from the verified cache (store.local.VERIFIED): the fill alone
  read / codec / sha256 / parse / fill: its stages alone
  baselines    (a) plain read + memcpy of the payload bytes, (a') the same through mmap, the sha256-tree alone (on
               identity.workers() threads), (b) SHA-256 alone over them, (c) torch.load of the
               same tensors (what pickle-based caches do), (d) safetensors load_file with every tensor copied
  prefill      engine.prefill of the prefix (what a graft saves), and graft vs prefill time to first token
               (restore + a 16-token query forward vs prefill of prefix + query), with the query's forward alone
               (the most any restore could reach)
  memory       peak RSS above the model of one graft in a fresh process: read with room (as `kvgraft graft`),
               read without room (the cache's first step copies), concatenated at every step
  codecs       a summary, one row per (codec, identity) side by side: file size, payload / file (the compression
               ratio) and the restore time, also as a ratio to the first row's (raw, sha256 by default)

GB/s are payload bytes (the canonical payload, whatever the file's codec) per second. Usage:
    python benchmarks/bench_restore.py [--tokens 2048 8192] [--dtypes float32 bfloat16] [--repeat 5]
                                    [--codecs zstd raw shuffle-zstd] [--identities sha256 sha256-tree]
                                    [--profile native|portable] [--no-prefill] [--attn eager|grouped] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_graft import _smol_config  # noqa: E402  (the same model shape)
from harness import interleaved, median, stopwatch, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--codecs", nargs="+", default=None, help="default: every codec this kvgraft writes")
    ap.add_argument(
        "--identities",
        nargs="+",
        default=["sha256", "sha256-tree"],
        help="identity schemes to restore side by side (the same cache, named each way)",
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", default="native", choices=["portable", "native"])
    ap.add_argument("--no-prefill", action="store_true", help="skip timing prefill (the slow part on a CPU)")
    ap.add_argument(
        "--attn",
        default="eager",
        choices=["eager", "grouped"],
        help="the manifests' attention implementation (grouped: engine.attention, no KV-head copies)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run end to end (tests/test_benchmarks.py): the embedded tiny model (its own manifest: "
        "--dtypes, --profile and --attn do not apply), 64 tokens, one repeat, no fresh processes for the peak RSS",
    )
    ap.add_argument("--write-model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rss-child", nargs=4, help=argparse.SUPPRESS)  # MANIFEST KVG SHA ROOM: peak RSS of one graft
    args = ap.parse_args()
    if args.rss_child:
        _rss_child(*args.rss_child)
        return
    if args.write_model:
        from kvgraft_cli.engine.tinymodel import write_tiny_model

        write_tiny_model(args.write_model, config=_smol_config())
        return
    from kvgraft_cli.config.manifest import dump_yaml, load_manifest, make_manifest
    from kvgraft_cli.config.modelhash import hash_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.smoke:
            manifest = load_manifest(None)
            args.tokens, args.repeat = [64], 1
            args.profile, args.attn = "portable", manifest.model.attn_implementation  # the embedded manifest's
            _run(manifest, args, tmp)
            return
        subprocess.run([sys.executable, __file__, "--write-model", str(tmp / "model")], check=True, capture_output=True)
        h = hash_model_dir(tmp / "model")
        for dtype in args.dtypes:
            data = make_manifest(
                str(tmp / "model"),
                h.model_sha256,
                h.tokenizer_sha256,
                profile=args.profile,
                device="cpu",
                dtype=dtype,
                attn_implementation=args.attn,
            )
            (tmp / f"{dtype}.yaml").write_text(dump_yaml(data))
        # One engine per dtype, in this process (the profile's kernel flags are applied before torch loads).
        for dtype in args.dtypes:
            _run(load_manifest(tmp / f"{dtype}.yaml"), args, tmp)


def _run(manifest, args, tmp: Path) -> None:
    import hashlib
    import os

    from kvgraft_cli.engine.engine import load_engine, tensor_sha256

    eng = load_engine(manifest)  # pins the manifest's environment before torch is imported
    import torch
    from safetensors.torch import load_file, save_file

    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.artifacts import payload as pl
    from kvgraft_cli.engine.growcache import SLACK_TOKENS

    dtype = manifest.model.dtype
    from kvgraft_cli.artifacts import container, identity

    variants = [(codec, scheme) for scheme in args.identities for codec in (args.codecs or list(container.CODECS))]
    print(
        f"\n## {dtype}: {type(eng.model).__name__} {sum(p.numel() for p in eng.model.parameters()) / 1e6:.0f}M, "
        f"profile {args.profile}, attention {args.attn}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; medians of {args.repeat}"
    )
    gen = torch.Generator().manual_seed(0)
    for n in args.tokens:
        # Room within the model's positions for the 16-token query, and for the RSS child's graft (its query through the
        # manifest's template, about 44 tokens, and 16 decode tokens).
        n = min(n, eng.max_positions - 64)
        ids = torch.randint(3, eng.model.config.vocab_size, (n,), generator=gen).tolist()
        query = torch.randint(3, eng.model.config.vocab_size, (16,), generator=gen).tolist()
        with stopwatch() as lap:
            cache, last = eng.prefill(ids)
        t_prefill_once = lap.s
        named = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
        payloads = {scheme: kvg.with_scheme(named, scheme) for scheme in args.identities}  # one cache, each name
        shas = {scheme: kvg.payload_identity(p) for scheme, p in payloads.items()}
        payload = payloads[args.identities[0]]
        size = len(payload)
        gbs = lambda t: size / t / 1e9  # noqa: E731
        rows: list[tuple[str, float, str]] = []

        # Baselines over the same bytes.
        raw_path = tmp / "plain.bin"
        raw_path.write_bytes(payload)
        dst = torch.empty(size, dtype=torch.uint8)

        def read_memcpy():
            b = raw_path.read_bytes()
            dst.copy_(torch.frombuffer(b, dtype=torch.uint8))

        import warnings

        warnings.filterwarnings("ignore", message="The given buffer is not writable")

        def mmap_memcpy():
            import mmap

            with open(raw_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                dst.copy_(torch.frombuffer(mm, dtype=torch.uint8))

        t_memcpy, _ = timed(read_memcpy, args.repeat)
        t_mmap, _ = timed(mmap_memcpy, args.repeat)
        t_sha, _ = timed(lambda: hashlib.sha256(payload).hexdigest(), args.repeat)
        tree = payloads.get("sha256-tree")
        t_tree, _ = timed(lambda: kvg.payload_identity(tree), args.repeat) if tree is not None else (None, None)
        tensors = {
            f"l{i}.{kv}": getattr(st, kv).contiguous()
            for i, st in enumerate(eng.capture(cache))
            if st.kind != "empty"
            for kv in ("keys", "values")
        }
        torch.save(tensors, tmp / "t.pt")
        save_file(tensors, str(tmp / "t.safetensors"))
        # Baseline (c) only, as issue #10 asks: what a pickle-based KV cache would pay. The file is one this run just
        # wrote, and weights_only=True restricts the unpickler to tensors; kvgraft's artifacts never use pickle.
        t_tload, _ = timed(lambda: torch.load(tmp / "t.pt", weights_only=True), args.repeat)
        t_st, _ = timed(lambda: {k: v.clone() for k, v in load_file(str(tmp / "t.safetensors")).items()}, args.repeat)
        rows += [("read + memcpy (a)", t_memcpy, ""), ("mmap + memcpy (a')", t_mmap, "")]
        if t_tree is not None:
            rows += [(f"sha256-tree alone ({identity.workers()} threads)", t_tree, "")]
        rows += [
            ("sha256 alone (b)", t_sha, ""),
            ("torch.load (c)", t_tload, ""),
            ("safetensors load_file + copy (d)", t_st, ""),
        ]

        t_restore_first = None
        summary: list[tuple[str, int, float, bool]] = []
        reference = eng.forward(eng.prefill(ids)[0], query)  # what every codec's restore must give, bit for bit
        for codec, scheme in variants:
            payload, sha, tag = payloads[scheme], shas[scheme], f"{codec}, {scheme}"
            path = tmp / f"a.{codec}.{scheme}.kvg"
            t_write, _ = timed(lambda: kvg.write_file(path, payload, codec=codec), 1)
            file_bytes = path.stat().st_size
            t_read, data = timed(lambda: path.read_bytes(), args.repeat)
            # The codec alone: the payload read back without its hash (raw: into a private buffer).
            t_codec, got = timed(lambda: pl.read_payload(path), args.repeat)
            assert got == payload
            t_parse, art = timed(lambda: kvg.decode(got), args.repeat)
            t_fill, _ = timed(lambda: eng.restore(art.layers), args.repeat)

            t_open, _ = timed(lambda: kvg.open_file(path, expected_sha256=sha), args.repeat)

            def restore():
                _, a = kvg.open_file(path, expected_sha256=sha)
                return eng.restore(a.layers)

            t_restore, restored = timed(restore, args.repeat)
            if t_restore_first is None or t_restore < t_restore_first:
                t_restore_first = t_restore
            exact = torch.equal(eng.forward(restored, query), reference)
            del restored

            def restore_with_room():  # as `kvgraft graft` reads (runs.graft.open_artifact): the cache takes the room
                _, a = kvg.open_file(path, sha, SLACK_TOKENS)
                return eng.restore(a.layers)

            t_room, roomy = timed(restore_with_room, args.repeat)
            exact_room = torch.equal(eng.forward(roomy, query), reference)
            del roomy
            summary.append((tag, file_bytes, t_restore, exact))
            rows += [
                (f"[{tag}] file {file_bytes / 1e6:.1f} MB ({size / file_bytes:.2f}x)", t_write, "write"),
                (f"[{tag}] read (whole file)", t_read, ""),
                (f"[{tag}] read + decode, no hash", t_codec, ""),
                (f"[{tag}] parse (decode, no hash)", t_parse, ""),
                (f"[{tag}] fill (engine.restore)", t_fill, ""),
                (f"[{tag}] open_file (read, hash, parse)", t_open, ""),
                (f"[{tag}] RESTORE (open_file + restore)", t_restore, f"exact {exact}"),
                (
                    f"[{tag}] RESTORE read with room (as graft)",
                    t_room,
                    f"exact {exact_room}" + ("" if codec == "raw" else " (room: raw files only)"),
                ),
                (f"[{tag}] again, from the verified cache", t_fill, "no read, no hash"),
            ]
        first_codec, first_scheme = variants[0]
        first_path, sha = tmp / f"a.{first_codec}.{first_scheme}.kvg", shas[first_scheme]
        print(f"\n{dtype}, {n} tokens, payload {size / 1e6:.1f} MB")
        # Peak RSS of one graft in a fresh process, three ways: as `kvgraft graft` reads (full layers read with the
        # growing cache's room, which the cache takes), read without room (the cache's first step copies every
        # layer into buffers of its own), and with the cache concatenating at every step (KVGRAFT_GROW_IN_PLACE=0).
        # A fourth child grafts as the first does under glibc's default malloc settings (KVGRAFT_KEEP_FREED=0,
        # util.memory.keep_freed_memory): its forward's page faults and time against the first's.
        children = [
            ("read with room, as `kvgraft graft -n 16`", "1", "1", "1"),
            ("read without room, first step copies", "0", "1", "1"),
            ("concatenated at every step", "0", "0", "1"),
            ("as graft, malloc defaults (KVGRAFT_KEEP_FREED=0)", "1", "1", "0"),
        ]
        for how, room, grow, keep in [] if args.smoke else children:
            child = subprocess.run(
                [sys.executable, __file__, "--rss-child", manifest.source, str(first_path), sha, room],
                capture_output=True,
                text=True,
                env={**os.environ, "KVGRAFT_GROW_IN_PLACE": grow, "KVGRAFT_KEEP_FREED": keep},
            )
            if child.returncode == 0:
                rss = json.loads(child.stdout)
                print(
                    f"peak RSS of a graft ({first_codec}, {first_scheme}; {how}), above the model: "
                    f"{rss['peak_above_model'] / 1e6:.1f} MB = {rss['peak_above_model'] / size:.2f}x the payload "
                    f"(the file read: {rss['peak_open'] / size:.3f}x; the restore: "
                    f"+{(rss['peak_restored'] - rss['peak_open']) / 1e6:.1f} MB; the query's forward and 16 decode "
                    f"steps: +{(rss['peak_above_model'] - rss['peak_restored']) / 1e6:.1f} MB); the read in "
                    f"this fresh process {rss['open_s']:.3f} s, then the graft (query + 16 tokens) "
                    f"{rss['graft_s']:.3f} s, {rss['graft_faults']:,} page faults"
                )
            else:  # e.g. a prefix this long leaves no room for the query within the model's positions
                last = (child.stderr.strip().splitlines() or ["?"])[-1]
                print(f"peak RSS of a graft ({how}): not measured, the graft failed: {last[:200]}")
        print(f"{'':52} {'seconds':>9} {'GB/s':>7} {'x memcpy':>9} {'x sha256':>9}")
        for name, t, note in rows:
            print(f"{name:52} {t:>9.4f} {gbs(t):>7.2f} {t_memcpy / t:>9.2f} {t_sha / t:>9.2f}  {note}")

        # The codecs' restores again, interleaved (raw, zstd, shuffle-zstd, raw, ...): on a shared machine a burst of
        # load then slows every codec alike, so their ratios hold even when the absolute times drift.
        def restore_from(codec: str, scheme: str):
            return lambda: eng.restore(
                kvg.open_file(tmp / f"a.{codec}.{scheme}.kvg", expected_sha256=shas[scheme])[1].layers
            )

        laps = interleaved({f"{c}, {s}": restore_from(c, s) for c, s in variants}, args.repeat)
        first = median(laps[summary[0][0]])
        print(
            f"\n{'codec, identity':26} {'file MB':>9} {'payload/file':>13} {'restore s':>10} {'GB/s':>6} "
            f"{'x first':>8}  {'interleaved':>11} {'x first':>8}  exact"
        )
        for tag, file_bytes, t, exact in summary:
            lap = median(laps[tag])
            print(
                f"{tag:26} {file_bytes / 1e6:>9.1f} {size / file_bytes:>12.3f}x {t:>10.4f} {gbs(t):>6.2f} "
                f"{t / summary[0][2]:>7.2f}x  {lap:>11.4f} {lap / first:>7.2f}x  {exact}"
            )
        # Decoding after a graft, the cache growing in place (engine.growcache) vs concatenated at every step
        # (KVGRAFT_GROW_IN_PLACE=0), interleaved; the logits must be the same bits.
        laps2: dict[str, list[float]] = {"1": [], "0": []}
        ends: dict[str, str] = {}
        for _ in range(args.repeat):
            for flag in ("1", "0"):
                os.environ["KVGRAFT_GROW_IN_PLACE"] = flag
                _, a = kvg.open_file(first_path, expected_sha256=sha)
                c = eng.restore(a.layers)
                del a
                with stopwatch() as lap:
                    lg = eng.forward(c, query)
                    for _ in range(32):
                        lg = eng.forward(c, [int(lg[-1].argmax())])
                laps2[flag].append(lap.s)
                ends[flag] = tensor_sha256(lg)
                del c
        os.environ.pop("KVGRAFT_GROW_IN_PLACE", None)
        t_in, t_cat = median(laps2["1"]), median(laps2["0"])
        print(
            f"query + 32 decode steps after the graft: in place {t_in:.3f} s, concatenated {t_cat:.3f} s "
            f"(in place / concatenated {t_in / t_cat:.2f}x), same logits bits: {ends['1'] == ends['0']}"
        )
        if not args.no_prefill:
            t_pre, _ = timed(lambda: eng.forward(eng.prefill(ids + query[:-1])[0], query[-1:]), 1)
            best = f"{first_codec}, {first_scheme}"  # the first codec and identity listed
            best_path = first_path

            def graft_ttft():  # as `kvgraft graft` reads: with the growing cache's room
                _, a = kvg.open_file(best_path, sha, SLACK_TOKENS)
                return eng.forward(eng.restore(a.layers), query)

            t_graft, _ = timed(graft_ttft, args.repeat)
            # The query's own forward over the restored prefix, the restore left out: what a graft costs with an
            # instant restore, so prefill / this is the most any restore could reach for this query.
            laps3 = []
            for _ in range(args.repeat):
                c = eng.restore(kvg.open_file(best_path, sha, SLACK_TOKENS)[1].layers)
                with stopwatch() as lap:
                    eng.forward(c, query)
                laps3.append(lap.s)
                del c
            t_query = median(laps3)
            print(
                f"prefill {n} tokens: {t_prefill_once:.2f} s; time to first token: prefill {t_pre:.3f} s, graft "
                f"({best}) {t_graft:.3f} s: graft is {t_pre / t_graft:.1f}x faster; the {len(query)}-token query's "
                f"forward alone {t_query:.3f} s ({t_query / t_graft:.0%} of the graft): no restore can do better "
                f"than {t_pre / t_query:.1f}x"
            )


def _rss_child(manifest_path: str, kvg_path: str, sha: str, room: str) -> None:
    """In a fresh process: load the engine, reset the peak-RSS mark, graft once as `kvgraft graft` does (open the
    file re-hashed, with room for the cache when ``room`` is "1" (runs.graft.open_artifact's), restore, release the
    artifact to the cache, a query and 16 decode tokens, one ledger line), print how far the peak rose."""
    import tempfile

    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine
    from kvgraft_cli.engine.growcache import SLACK_TOKENS
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.graft import Loaded, graft_generate

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    eng = load_engine(load_manifest(Path(manifest_path)))
    tmp = Path(tempfile.mkdtemp())
    ctx = RunContext.make(eng.manifest, tmp / "store", tmp / "ledger.jsonl")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    with stopwatch() as lap:
        loaded = Loaded(*kvg.open_file(Path(kvg_path), sha, SLACK_TOKENS if room == "1" else 0), kvg_path)
    t_open = lap.s
    opened = status("VmHWM") - base
    import resource

    restored = []  # the peak right after engine.restore_chain, inside the graft
    plain_restore = eng.restore_chain
    eng.restore_chain = lambda chain: (lambda c: restored.append(status("VmHWM") - base) or c)(plain_restore(chain))
    faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    graft_generate(ctx, eng, loaded, "What is the final answer?", 16)
    t_graft, faults = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(
        json.dumps(
            {
                "peak_above_model": status("VmHWM") - base,
                "peak_open": opened,
                "peak_restored": restored[0],
                "open_s": t_open,
                "graft_s": t_graft,
                "graft_faults": faults,
            }
        )
    )


if __name__ == "__main__":
    main()
