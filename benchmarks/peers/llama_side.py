"""The llama.cpp side of bench_peers, in a worker process: llama-cpp-python's low-level bindings (ctypes over
llama.h), so every step is the C API a llama.cpp user calls, timed around that call alone:
  prefill     llama_decode over the prefix (n_batch tokens a call; llama.cpp splits each into n_ubatch micro-batches)
  save        llama_state_seq_save_file of sequence 0: its KV cache and token ids, in llama.cpp's own format
  restore     llama_state_seq_load_file into a fresh context (created beforehand, as kvgraft's engine is loaded)
  first token restore + llama_decode of the query, to the query's last logits
  decode      greedy steps after that (argmax of the logits, one-token llama_decode each), tokens a second
Exactness: the first token's logits after a restore are compared byte for byte with a fresh prefill of the same
prefix in a fresh context, then the same query (the split a graft makes), at each thread count asked; and with one
llama_decode over prefix + query (one pass), as a user who never saved a state computes it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from harness import stopwatch


class LlamaSide:
    def __init__(self, site: str, gguf: str, threads: int):
        sys.path.append(site)  # appended: the venv's numpy comes first
        import llama_cpp as L
        import numpy as np

        self.np, self.L = np, L
        self._quiet = L.llama_log_callback(lambda level, text, user: None)  # kept alive: llama.cpp holds the pointer
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.threads = threads
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-peers-llama-"))
        self.state: dict = {}

    def info(self) -> dict:
        import llama_cpp

        p = self.L.llama_context_default_params()
        return {
            "version": llama_cpp.__version__,
            "system_info": self.L.llama_print_system_info().decode().strip(),
            "n_vocab": self.n_vocab,
            "n_batch": p.n_batch,
            "n_ubatch": p.n_ubatch,
            "flash_attn_type": p.flash_attn_type,
            "type_k": p.type_k,
            "type_v": p.type_v,
        }

    # -- the C API, thinly ----------------------------------------------------------------------------------------
    @contextmanager
    def _context(self, n_ctx: int, threads: int):
        """A fresh llama.cpp context (its own KV cache) for the block, freed after it."""
        p = self.L.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        ctx = self.L.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {n_ctx})")
        try:
            yield ctx
        finally:
            self.L.llama_free(ctx)

    def _decode(self, ctx, ids: list[int], start: int):
        """llama_decode ``ids`` at positions start.. on sequence 0, n_batch tokens a call; the last token's logits
        (a copy: llama.cpp reuses the buffer)."""
        L, np = self.L, self.np
        n_batch = self.L.llama_n_batch(ctx)
        batch = L.llama_batch_init(n_batch, 0, 1)
        try:
            for at in range(0, len(ids), n_batch):
                part = ids[at : at + n_batch]
                batch.n_tokens = len(part)
                for i, tok in enumerate(part):
                    batch.token[i] = tok
                    batch.pos[i] = start + at + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = at + i == len(ids) - 1
                rc = L.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            L.llama_batch_free(batch)
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,)).copy()

    def _greedy(self, ctx, logits, at: int, n: int) -> list[int]:
        out = []
        for i in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            logits = self._decode(ctx, [tok], at + i)
        return out

    def _save(self, ctx, path: Path, ids: list[int]) -> int:
        arr = (self.L.llama_token * len(ids))(*ids)
        size = self.L.llama_state_seq_save_file(ctx, str(path).encode(), 0, arr, len(ids))
        if not size:
            raise RuntimeError("llama_state_seq_save_file failed")
        return size

    def _load(self, ctx, path: Path, n: int) -> None:
        out = (self.L.llama_token * n)()
        count = ctypes.c_size_t(0)
        if not self.L.llama_state_seq_load_file(ctx, str(path).encode(), 0, out, n, ctypes.byref(count)):
            raise RuntimeError("llama_state_seq_load_file failed")
        if count.value != n:
            raise RuntimeError(f"restored {count.value} tokens, saved {n}")

    # -- the benchmark's steps --------------------------------------------------------------------------------
    def setup(self, ids: list[int], query: list[int], decode: int) -> dict:
        """Prefill the prefix in a fresh context, save its state, then the query and ``decode`` greedy steps:
        the fresh reference that every restore is compared with."""
        n_ctx = len(ids) + len(query) + decode + 16
        path = self.tmp / "seq0.state"
        with self._context(n_ctx, self.threads) as ctx:
            with stopwatch() as pre:
                self._decode(ctx, ids, 0)
            with stopwatch() as save:
                size = self._save(ctx, path, ids)
            fresh = self._decode(ctx, query, len(ids))
            tokens = self._greedy(ctx, fresh, len(ids) + len(query), decode)
        self.state = {
            "ids": ids,
            "query": query,
            "decode": decode,
            "n_ctx": n_ctx,
            "path": path,
            "fresh": fresh.tobytes(),
            "tokens": tokens,
        }
        return {"prefill_s": pre.s, "save_s": save.s, "state_bytes": size, "file_bytes": path.stat().st_size}

    def round(self) -> dict:
        """One restore into a fresh context, the query (first token), then the decode steps, each timed."""
        s = self.state
        n, at = len(s["ids"]), len(s["ids"]) + len(s["query"])
        with self._context(s["n_ctx"], self.threads) as ctx:
            with stopwatch() as first:
                with stopwatch() as restore:
                    self._load(ctx, s["path"], n)
                logits = self._decode(ctx, s["query"], n)
            with stopwatch() as dec:
                tokens = self._greedy(ctx, logits, at, s["decode"])
        return {
            "restore_s": restore.s,
            "first_token_s": first.s,
            "decode_tok_s": s["decode"] / dec.s,
            "exact": logits.tobytes() == s["fresh"],
            "same_tokens": tokens == s["tokens"],
            "logits_sha256": hashlib.sha256(logits.tobytes()).hexdigest(),
        }

    def exactness(self, threads: list[int]) -> dict:
        """Per thread count: fresh prefill + save + query in one fresh context, restore + query in another, and one
        llama_decode over prefix + query in a third; whether the restored logits equal the fresh ones (bytes), and
        whether either equals the one-pass logits. Also whether the fresh logits agree across thread counts."""
        s = self.state
        ids, query, n = s["ids"], s["query"], len(s["ids"])
        out, fresh_by_threads = {}, {}
        for t in threads:
            path = self.tmp / f"seq0-{t}.state"
            with self._context(s["n_ctx"], t) as ctx:
                self._decode(ctx, ids, 0)
                self._save(ctx, path, ids)
                fresh = self._decode(ctx, query, n).tobytes()
            with self._context(s["n_ctx"], t) as ctx:
                self._load(ctx, path, n)
                restored = self._decode(ctx, query, n).tobytes()
            with self._context(s["n_ctx"], t) as ctx:
                one = self._decode(ctx, ids + query, 0).tobytes()
            os.unlink(path)
            fresh_by_threads[t] = fresh
            out[str(t)] = {
                "restore_exact": restored == fresh,
                "fresh_equals_one_pass": fresh == one,
                "restored_equals_one_pass": restored == one,
                "max_abs_diff": self._max_abs_diff(restored, fresh),
                "one_pass_max_abs_diff": self._max_abs_diff(fresh, one),
            }
        first = fresh_by_threads[threads[0]]
        out["fresh_same_across_threads"] = all(v == first for v in fresh_by_threads.values())
        return out

    def tamper(self) -> dict:
        """One byte of the saved state flipped, three quarters in (inside the KV data), then loaded into a fresh
        context: whether llama.cpp loads it, and whether the first token's logits then differ from the fresh ones.
        Its loader checks the file's magic, version, token count and each layer's types and row sizes; no hash."""
        s = self.state
        bad = self.tmp / "tampered.state"
        raw = bytearray(s["path"].read_bytes())
        raw[len(raw) * 3 // 4] ^= 0x40
        bad.write_bytes(bytes(raw))
        n = len(s["ids"])
        try:
            with self._context(s["n_ctx"], self.threads) as ctx:
                try:
                    self._load(ctx, bad, n)
                except RuntimeError as e:
                    return {"loaded": False, "error": str(e)}
                logits = self._decode(ctx, s["query"], n)
        finally:
            bad.unlink()
        return {"loaded": True, "logits_changed": logits.tobytes() != s["fresh"]}

    def _max_abs_diff(self, a: bytes, b: bytes) -> float:
        np = self.np
        return float(np.abs(np.frombuffer(a, dtype=np.float32) - np.frombuffer(b, dtype=np.float32)).max())


def serve_llama(site: str, gguf: str, threads: int) -> None:
    from peers.wire import serve

    side = LlamaSide(site, gguf, threads)
    serve(
        {
            "info": side.info,
            "setup": side.setup,
            "round": side.round,
            "exactness": side.exactness,
            "tamper": side.tamper,
        }
    )
