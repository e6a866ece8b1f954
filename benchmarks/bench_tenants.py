"""Tenants and the prompt cache on the real model: does a second tenant's first request on a prompt take a cold
request's time, and what does a warm first token cost with keys, tenants and the bound on? (Issue #47.)

In a fresh folder, `kvgraft serve -m manifests/smollm2-serve.yaml` (the real SmolLM2-135M-Instruct GGUF, chunks of
16) with two API keys. Each round sends one new chat (a shared system prompt of about --system tokens, then a new
question) in this order: tenant A (cold), A again (warm), tenant B (its first: cold if tenants are isolated),
A with a cache_salt (cold), B again (warm). The first-token seconds are the server's own (the ledger line's
``outputs.costs.first_token_s``: from the request leaving the queue to its first token). With ``--compare-root
DIR`` a second server runs from another checkout (``PYTHONPATH=DIR``: say, the commit before the bound and keys,
without keys) beside it, rounds interleaved, and its cold and warm first tokens are printed in the same table.
Each round's system prompt is new (``Session N.``), so a round's first request is cold on both servers. --manifest
serves another manifest instead (its model path taken as absolute).
Usage:
    python benchmarks/bench_tenants.py [--rounds 5] [--system 1000] [--compare-root DIR] [--manifest M] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # serve_exactness.start
MANIFEST = REPO / "manifests" / "smollm2-serve.yaml"
MATH = REPO / "data" / "math500" / "math500.jsonl"
KEYS = ("bench-key-a", "bench-key-b")


def start(folder: Path, args: list[str], root: Path | None) -> tuple[subprocess.Popen, str]:
    """A server in ``folder`` (serve_exactness.start), run from the checkout ``root`` when given."""
    from serve_exactness import start as start_server

    env = dict(os.environ, PYTHONPATH=str(root)) if root is not None else None
    return start_server(folder, *args, env=env)


def post(url: str, body: dict, key: str | None) -> dict:
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def first_token(folder: Path, seq: int, ledger: str = "kvgraft-serve-ledger.jsonl") -> float:
    """The server's own first-token seconds of line ``seq`` of its ledger (the manifest's paths.ledger)."""
    from kvgraft_cli.ledger import entries
    from kvgraft_cli.ledger.entries import ServeEntry

    line = next(e for e in entries.read(folder / ledger, (ServeEntry,), start=seq) if e.seq == seq)
    return float(line.costs["first_token_s"])  # (a ledger writes no floats: a string)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--system", type=int, default=1000, help="about this many tokens of shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--compare-root", type=Path, help="another checkout whose server runs beside (without keys)")
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="the manifest served (default: the serve one)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import yaml

    from kvgraft_cli.config.manifest import load_manifest

    text, served = a.manifest.read_text(), load_manifest(a.manifest)
    if not served.model.path.startswith("package:") and not Path(served.model.path).is_absolute():
        data = yaml.safe_load(text)  # copied into other folders: its model where it is
        data["model"]["path"] = str((a.manifest.resolve().parent / served.model.path).resolve())
        text = yaml.safe_dump(data, sort_keys=False)
    rows = [json.loads(x) for x in MATH.read_text().splitlines()]
    system = "You are a careful tutor. Reference solutions:\n\n"
    for r in rows[200:]:
        if len(system) > 4 * a.system:
            break
        system += r["answer"] + "\n\n"
    base = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    here, there = base / "here", base / "there"
    for d in (here, there):
        d.mkdir()
        (d / "serve.yaml").write_text(text)
    servers = {"here": start(here, ["--api-key", KEYS[0], "--api-key", KEYS[1]], None)}
    if a.compare_root:
        servers["there"] = start(there, [], a.compare_root)
    times: dict[str, list[float]] = {}
    seqs = {"here": 0, "there": 0}
    try:
        for i in range(a.rounds):
            question = rows[300 + i]["question"]
            # A system prompt of its own a round: the first request of a round is cold on both servers
            body = {
                "model": served.name,
                "messages": [
                    {"role": "system", "content": f"Session {i + 1}. {system}"},
                    {"role": "user", "content": question},
                ],
                "max_tokens": a.max_tokens,
            }
            plan = [
                ("here", "A cold", KEYS[0], {}),
                ("here", "A warm", KEYS[0], {}),
                ("here", "B first", KEYS[1], {}),
                ("here", "A salted first", KEYS[0], {"cache_salt": f"s{i}"}),
                ("here", "B warm", KEYS[1], {}),
            ]
            if "there" in servers:
                plan = [x for pair in zip(plan[:2], [("there", "before: cold", None, {}), ("there", "before: warm", None, {})], strict=True) for x in pair] + plan[2:]  # fmt: skip
            texts = set()
            for where, name, key, extra in plan:
                d = post(servers[where][1], {**body, **extra}, key)
                texts.add(d["choices"][0]["message"]["content"])
                t = first_token(here if where == "here" else there, seqs[where], served.paths.ledger)
                seqs[where] += 1
                times.setdefault(name, []).append(t)
            assert len(texts) == 1, texts  # every tenant, cold or warm: the same answer
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(
        f"\n{'request':<18} {'first token, median s':>22} {'min':>8} {'max':>8}   ({a.rounds} rounds, {time.strftime('%Y-%m-%d')})"
    )
    for name, v in times.items():
        print(f"{name:<18} {statistics.median(v):>22.3f} {min(v):>8.3f} {max(v):>8.3f}")
    if a.json:
        write_json(a.json, {"rounds": a.rounds, "system_tokens": a.system, "first_token_s": times}, **vars(a))


if __name__ == "__main__":
    main()
