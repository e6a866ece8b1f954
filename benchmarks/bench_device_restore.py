"""Benchmark: restoring a raw .kvg artifact onto a device, side by side in one process (medians of --repeat,
interleaved so a burst of load slows each alike; the file is in the page cache after the warm-up):

  open_file + .to(device)   format.open_file (read into host memory, re-hash, parse), then each tensor copied over
  open_file_on_device       artifacts.device_restore: pinned staging ring, copies overlapping the read and the hash
  pinned -> device copy     one copy of the payload's bytes from pinned host memory: the link's ceiling

Both restores re-hash every byte (no expected identity is passed, so each computes it). Without CUDA it runs the
cpu device (a host-to-host copy as the "ceiling") and says so. GB/s are payload bytes per second. Builds a random
payload of SmolLM-135M's KV shape (benchmarks/bench_graft.py's config; no model, no prefill), or takes --kvg FILE.
    python benchmarks/bench_device_restore.py [--tokens 2048] [--dtype float32] [--repeat 5] [--device cuda]
                                           [--identity sha256|sha256-tree] [--chunk-mib 16] [--ring 4] [--kvg FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_graft import _smol_config  # noqa: E402  (the same model shape as the other benchmarks)
from harness import interleaved, median  # noqa: E402


def _random_payload(tokens: int, dtype: str, scheme: str) -> bytes:
    import torch

    from kvgraft_cli.artifacts import format as kvg

    cfg, g = _smol_config(), torch.Generator().manual_seed(0)
    shape = (1, cfg.num_key_value_heads, tokens, cfg.hidden_size // cfg.num_attention_heads)
    layers = [
        kvg.LayerState(
            "full",
            torch.randn(shape, generator=g).to(getattr(torch, dtype)),
            torch.randn(shape, generator=g).to(getattr(torch, dtype)),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    meta = {k: "x" for k in kvg.REQUIRED_META}
    meta.update(dtype=dtype, start_position="0", prefill="{}", **({"identity": scheme} if scheme != "sha256" else {}))
    return kvg.encode(list(range(tokens)), layers, meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--identity", default="sha256", choices=["sha256", "sha256-tree"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default=None, help="default: cuda when torch sees a GPU, else cpu")
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--ring", type=int, default=4)
    ap.add_argument("--kvg", type=Path, help="an existing raw .kvg file instead of a random payload")
    args = ap.parse_args()

    import torch

    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.artifacts import identity
    from kvgraft_cli.artifacts import payload as pl
    from kvgraft_cli.artifacts.device_restore import open_file_on_device

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.kvg or Path(tmp) / "a.kvg"
        payload = pl.read_payload(path) if args.kvg else _random_payload(args.tokens, args.dtype, args.identity)
        if not args.kvg:
            kvg.write_file(path, payload, codec="raw")
        size, want = len(payload), identity.payload_identity(payload)
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        kw = dict(chunk_bytes=args.chunk_mib << 20, ring=args.ring)

        def plain():
            _, art = kvg.open_file(path)
            out = [(l.keys.to(device), l.values.to(device)) for l in art.layers if l.kind != "empty"]
            sync()
            return out

        def staged():
            return open_file_on_device(path, device, **kw)

        def ceiling():
            dst.copy_(pinned, non_blocking=cuda)
            sync()

        runs = {
            "open_file + .to(device)": plain,
            "open_file_on_device": staged,
            f"{'pinned' if cuda else 'host'} -> {device.type} copy": ceiling,
        }
        got, art = staged()  # warm-up: CUDA context, pinned staging, page cache; and a check that it is right
        ref = plain()
        assert got == want and all(
            torch.equal(a.keys, k) and torch.equal(a.values, v)
            for a, (k, v) in zip([l for l in art.layers if l.kind != "empty"], ref)
        )
        laps = interleaved(runs, args.repeat)
    where = torch.cuda.get_device_name(device) if cuda else "no CUDA here: staging unpinned, copies synchronous"
    print(
        f"{device} ({where}); torch {torch.__version__}; payload {size / 1e6:.1f} MB ({args.dtype}, "
        f"{args.identity}); staging {args.ring} x {args.chunk_mib} MiB; medians of {args.repeat}"
    )
    print(f"{'':28} {'seconds':>9} {'GB/s':>7}")
    for name, times in laps.items():
        t = median(times)
        print(f"{name:28} {t:>9.4f} {size / t / 1e9:>7.2f}")


if __name__ == "__main__":
    main()
