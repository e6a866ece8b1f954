"""The kvgraft side of bench_peers, in a worker process of its own per configuration (dtype, kernel-flag profile,
attention, weights: dequantized or q4, the cache's width, the artifact identity): the same GGUF, dequantized by `kvgraft manifest init` into the user's cache, under a manifest pinned
here, through kvgraft's own functions, each timed around what the command does:
  prefill      engine.prefill (the manifest's schedule)
  deposit      capture, canonical payload, identity (SHA-256 tree), atomic write of ``<identity>.kvg``: what
               `kvgraft deposit` does after its prefill
  graft        what `kvgraft graft` does to open an artifact: read it, re-hash it against its identity (verified
               before anything is returned), restore it into a fresh cache, whose memory was reserved beforehand
               (growcache.BufferPool, as kvgraft serve reserves it at start and llama.cpp's context holds its KV
               buffer from creation: the pages are resident, so the read pays no page faults)
  graft, fresh the same into memory fresh from the OS (a one-shot `kvgraft graft` process: every page faulted in)
  first token  graft + the query's forward, to its last logits
  decode       greedy steps after that (engine.greedy), tokens a second
Exactness: the first token's logits after every graft are compared byte for byte (SHA-256) with the fresh
prefill's; `kvgraft graft --check` is run on the artifact as a user runs it (a child process, its --json verdict).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_graft import _open, _real_ids  # an artifact opened as `kvgraft graft` opens it; the real-text prefix
from harness import stopwatch


class KvgraftSide:
    def __init__(
        self,
        gguf: str,
        dtype: str,
        profile: str,
        attn: str,
        threads: int,
        schedule: str,
        weights: str = "dequantized",
        kv_dtype: str | None = None,
        identity: str = "sha256-tree",
    ):
        # The profile's kernel flags before torch is imported (engine.determinism); then the manifest pins them.
        from kvgraft_cli.engine.determinism import pin_profile

        pin_profile(profile, "cpu")
        import yaml

        from kvgraft_cli.config.manifest import load_manifest
        from kvgraft_cli.engine.engine import load_engine
        from kvgraft_cli.engine.gguf import manifest_for_gguf

        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-peers-kvgraft-{dtype}-"))
        self.manifest_path = self.tmp / "manifest.yaml"
        text, _ = manifest_for_gguf(
            gguf,
            self.manifest_path,
            profile=profile,
            device="cpu",
            dtype=dtype,
            threads=threads,
            attn_implementation=attn,
            weights=weights,
            kv_dtype=kv_dtype,
            identity=identity,
        )
        data = yaml.safe_load(text)
        if schedule != "single":  # chunked:N
            data["prefill"] = {"schedule": "chunked", "chunk_size": int(schedule.split(":")[1])}
        data["paths"] = {"store": str(self.tmp / "store"), "ledger": str(self.tmp / "ledger.jsonl")}
        self.manifest_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.eng = load_engine(load_manifest(self.manifest_path))
        self.state: dict = {}
        self.pool = None

    def info(self) -> dict:
        import torch
        import transformers

        m = self.eng.manifest
        return {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "model_sha256": m.model.sha256,
            "threads": torch.get_num_threads(),
            "env": {k: v for k, v in m.runtime.env.items() if v},
            "schedule": m.prefill.as_written(),
            "attn": m.model.attn_implementation,
            "weights": m.model.weights,
            "kv_dtype": m.model.kv_dtype or m.model.dtype,
            "identity": m.artifact.identity,
        }

    def ids(self, n: int) -> dict:
        """The first ``n`` tokens of MATH-500's worked solutions joined, as bench_graft cuts them."""
        return {"ids": _real_ids(self.eng, n)}

    def setup(self, ids: list[int], query: list[int], decode: int) -> dict:
        """Prefill, deposit, then the query and ``decode`` greedy steps on the fresh cache: the reference."""
        from kvgraft_cli.artifacts import format as kvg
        from kvgraft_cli.engine.engine import tensor_sha256
        from kvgraft_cli.engine.growcache import BufferPool, enabled

        eng = self.eng
        self.state, self.pool = {}, None  # the last length's cache and artifact go before this one's are made
        with stopwatch() as pre:
            cache, last = eng.prefill(ids)
        with stopwatch() as dep:
            payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
            sha = kvg.payload_identity(payload)
            path = self.tmp / f"{sha}.kvg"
            kvg.write_file(path, payload)
        size = len(payload)
        del payload
        fresh = eng.forward(cache, query, last_only=True)[-1]
        tokens, _ = eng.greedy(cache, fresh, decode)
        del cache
        if enabled(eng.device):  # this length's cache memory, reserved as a server reserves it at start
            self.pool = BufferPool()
            self.pool.reserve(*eng.cache_buffers(len(ids) + len(query) + decode))
        self.state = {
            "ids": ids,
            "query": query,
            "decode": decode,
            "path": path,
            "sha": sha,
            "fresh": tensor_sha256(fresh),
            "tokens": tokens,
        }
        # save_s: the deposit; the same key as llama.cpp's state save, so the table reads both alike.
        return {"prefill_s": pre.s, "save_s": dep.s, "artifact_bytes": size, "file_bytes": path.stat().st_size}

    def round(self) -> dict:
        """One graft (read, verify, restore) into a fresh cache, the query (first token), then the decode steps."""
        from kvgraft_cli.engine.engine import tensor_sha256
        from kvgraft_cli.engine.growcache import pooled

        eng, s = self.eng, self.state
        with stopwatch() as fresh_pages:
            cache = eng.restore(_open(s["path"], s["sha"], eng.device).layers)
        del cache
        with pooled(self.pool):
            with stopwatch() as first:
                with stopwatch() as graft:
                    cache = eng.restore(_open(s["path"], s["sha"], eng.device).layers)
                logits = eng.forward(cache, s["query"], last_only=True)[-1]
            with stopwatch() as dec:
                tokens, _ = eng.greedy(cache, logits, s["decode"])
            del cache  # its memory back to the pool before the scope ends
        sha = tensor_sha256(logits)
        return {
            "restore_s": graft.s,
            "restore_fresh_s": fresh_pages.s,
            "first_token_s": first.s,
            "decode_tok_s": s["decode"] / dec.s,
            "exact": sha == s["fresh"],
            "same_tokens": tokens == s["tokens"],
            "logits_sha256": sha,
        }

    def tamper(self) -> dict:
        """One byte of the artifact flipped, three quarters in (inside the KV data), then opened as `kvgraft graft`
        opens it: whether it is refused (re-hashed against its identity), and with what message."""
        from kvgraft_cli.errors import KvgraftError

        s = self.state
        bad = self.tmp / "tampered" / s["path"].name
        bad.parent.mkdir(exist_ok=True)
        raw = bytearray(s["path"].read_bytes())
        raw[len(raw) * 3 // 4] ^= 0x40
        bad.write_bytes(bytes(raw))
        try:
            _open(bad, s["sha"], self.eng.device)
        except KvgraftError as e:
            return {"loaded": False, "error": str(e).splitlines()[0].replace(f"{bad.parent}/", "")[:160]}
        finally:
            bad.unlink()
        return {"loaded": True}

    def weights(self) -> dict:
        """What a decode step must read, and the floor that sets: the model's weight bytes (the tied embedding
        counted once: as the head it is read whole every step), and the seconds of its linear layers alone on one
        token (each layer's matrix-vector product, nothing between them): a decode step cannot be faster."""
        import torch
        from harness import timed

        model = self.eng.model
        params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
        # q4 (engine.quantized): the int4 layers' codes, scales and zeros are read instead; the embedding is then
        # read one row a token (the head is its int4 planes), so it no longer counts.
        quant = [m for m in model.modules() if hasattr(m, "scales_zeros")]
        if quant:
            params.pop(model.get_input_embeddings().weight.data_ptr(), None)
        weight_bytes = sum(params.values()) + sum(m.nbytes for m in quant)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)] + quant
        dtype = next(model.parameters()).dtype
        rows = {
            m.in_features: torch.randn(1, m.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
            for m in linears
        }

        def one_token():
            with torch.inference_mode():
                for m in linears:
                    m(rows[m.in_features])

        one_token()  # warm: oneDNN's first call for a shape prepares its kernel
        floor, _ = timed(one_token, 7)
        return {"weight_bytes": weight_bytes, "linear_floor_s": floor, "linears": len(linears)}

    def check(self, samples: int, max_new_tokens: int) -> dict:
        """`kvgraft graft --check` on the deposited file, as a user runs it; its --json verdict."""
        cmd = [
            sys.executable,
            "-m",
            "kvgraft_cli",
            "graft",
            str(self.state["path"]),
            "--check",
            "--samples",
            str(samples),
            "-n",
            str(max_new_tokens),
            "-m",
            str(self.manifest_path),
            "--json",
        ]
        with stopwatch() as lap:
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=self.tmp)
        if p.returncode not in (0, 1):  # 1 is a failed check: a verdict, reported
            raise RuntimeError(f"graft --check exited {p.returncode}: {p.stderr.strip()[-1500:]}")
        r = json.loads(p.stdout)
        return {
            "passed": r["passed"],
            "sha_equal": r["sha_equal"],
            "samples": r["samples"],
            "check_s": lap.s,
            "deposit_reproduced": r["deposit_reproduced"],
            "single_pass_sha_equal": r["single_pass_sha_equal"],
            "single_pass_max_abs_diff": r["single_pass_max_abs_diff"],
        }


def serve_kvgraft(*args, **kwargs) -> None:
    """A worker's loop around ``KvgraftSide(*args, **kwargs)``."""
    from peers.wire import serve

    side = KvgraftSide(*args, **kwargs)
    serve(
        {
            "info": side.info,
            "ids": side.ids,
            "setup": side.setup,
            "round": side.round,
            "check": side.check,
            "tamper": side.tamper,
            "weights": side.weights,
        }
    )
