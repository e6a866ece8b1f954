"""Continuous batching as users meet it: `kvgraft serve` and `kvgraft solve` on a Llama GGUF kept at its 4-bit codes
(tests/ggufblocks.py's tiny one, built like SmolLM2's), where the lean forward's batched decode step is in force.

What is checked: requests sent at once, of different lengths, joining and leaving the batch at different steps,
each get the response and the ledger line (but its times) the same request gets alone on a server that decodes one
at a time; 16 clients of mixed requests sharing a prompt cache, every response the request's alone, one ledger line
each, `verify` passing; a client gone mid-batch and SIGTERM mid-batch lose no answered request; `solve --batch`
writes the outputs file and ledger entries (but their costs) of a one-at-a-time run. The in-process checks of the
step itself (and that a step batching a dense product is caught) are test_lean.py's; the real model's batched
serving is test_gguf.py's, and the main job's batched solves replay its prereg in test_main_prereg.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml
from conftest import EXAMPLES, run_cli
from ggufblocks import tiny_llama
from serving import Served, chat, ledger_lines, start

pytestmark = pytest.mark.xdist_group("batching")  # one worker builds the GGUF's manifest once

MODEL = "tiny-q4"
TIMING = ("wall_s", "queue_s", "first_token_s", "cpu_s", "energy_j")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with the tiny Llama GGUF, a q4 manifest written by `manifest init` (the CPU's default profile), and
    serve.yaml: that manifest with prefill in chunks of 16 (the prompt cache) and decode budgets that fit its 256
    positions. (folder, the environment its commands run with.)"""
    d = tmp_path_factory.mktemp("batching")
    tiny_llama(d / "tiny.gguf")
    env = {"KVGRAFT_MODEL_CACHE": str(d / "models")}
    run_cli(
        "manifest", "init", "tiny.gguf", "--weights", "q4", "--attn", "grouped", "-o", "m.yaml", cwd=d, env=env,
        check_rc=0,
    )  # fmt: skip
    data = yaml.safe_load((d / "m.yaml").read_text())
    data["name"] = MODEL
    data["model"]["path"] = str(d / "tiny.gguf")  # the copies in other folders load it too
    data["prefill"] = {"schedule": "chunked", "chunk_size": 16}
    data["decode"] = {"max_new_tokens": 40, "answer_tokens": 8}
    (d / "serve.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return d, env


def _copy(folder: tuple[Path, dict], to: Path) -> Path:
    """A folder of its own (its store and ledger) with the serve manifest."""
    to.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder[0] / "serve.yaml", to)
    return to


def _requests() -> list[tuple[str, dict]]:
    """Prompts of 5 to about 130 tokens and budgets of 1 to 40, streaming and not, chats and completions: sent at
    once they join the batch and leave it at different steps. No two share a chunk (each deposits its own)."""
    reqs: list[tuple[str, dict]] = []
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    for i in range(12):
        text = f"Q{i}: " + " ".join(words[: (i * 5) % 12 + 1]) * (1 + i % 2)
        budget = [40, 3, 25, 1, 17, 40, 9, 33, 5, 12, 40, 2][i]
        if i % 3 == 2:
            reqs.append(("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": budget}))
        else:
            reqs.append(("/v1/chat/completions", chat(text, model=MODEL, max_tokens=budget, stream=i % 2 == 1)))
    return reqs


def _send(s: Served, path: str, body: dict) -> tuple:
    """(text, first-token logits hash, generated ids hash, ledger seq) as the client sees them."""
    if body.get("stream"):
        client = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=300)
        text, last = "", None
        for chunk in client.chat.completions.create(**body):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                last = chunk
        assert last is not None and last.model_extra is not None
        k = last.model_extra["kvgraft"]
    else:
        status, data = s.post(path, body)
        assert status == 200, data
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        k = data["kvgraft"]
    return text, k["first_logits_sha256"], k["generated_ids_sha256"], k["ledger"]["seq"]


def _health(s: Served) -> dict:
    status, _, body = s.request("GET", "/health")
    assert status == 200
    return json.loads(body)


def _line_but_times(e: dict) -> dict:
    """A ledger line without what differs run to run: its place in the ledger, its time, the costs' seconds."""
    e = json.loads(json.dumps(e))
    for k in ("seq", "prev", "time"):
        e.pop(k, None)
    costs = e.get("outputs", {}).get("costs", {})
    for k in TIMING:
        costs.pop(k, None)
    return e


def test_requests_at_once_are_each_the_request_alone(folder, tmp_path):
    """12 requests from 12 clients at once into steps of at most 4 rows (they join as others leave) on one server,
    the same 12 one after another on a server that decodes one at a time: the same text, first-token logits hash,
    generated ids and ledger line (but its seq, time and seconds) for every request."""
    reqs = _requests()
    alone_dir, batched_dir = _copy(folder, tmp_path / "alone"), _copy(folder, tmp_path / "batched")
    s = start(alone_dir, "-m", "serve.yaml", "--batch", "1", env=folder[1])
    try:
        assert _health(s)["batch"]["max"] == 1
        alone = [_send(s, p, b) for p, b in reqs]
    finally:
        assert s.stop() == 0
    s = start(batched_dir, "-m", "serve.yaml", "--batch", "4", env=folder[1])
    try:
        assert s.said("up to 4 requests decoded together")

        def send(i: int) -> tuple:
            time.sleep(0.03 * i)  # arriving while others decode: they join at step boundaries
            return _send(s, *reqs[i])

        with ThreadPoolExecutor(len(reqs)) as pool:
            together = list(pool.map(send, range(len(reqs))))
        batch = _health(s)["batch"]
    finally:
        assert s.stop() == 0
    assert batch["max"] == 4 and batch["note"] is None
    assert batch["rows"] > batch["steps"]  # steps of several requests were computed
    assert [x[:3] for x in together] == [x[:3] for x in alone]
    lines_alone = {e["inputs"]["request"]["sha256"]: e for e in ledger_lines(alone_dir / "kvgraft-ledger.jsonl")}
    lines_batched = ledger_lines(batched_dir / "kvgraft-ledger.jsonl")
    assert len(lines_batched) == len(lines_alone) == len(reqs)
    for e in lines_batched:
        assert _line_but_times(e) == _line_but_times(lines_alone[e["inputs"]["request"]["sha256"]])
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=batched_dir, env=folder[1], check_rc=0)


def _mixed() -> list[tuple[str, dict]]:
    """Requests that share a long system prompt (the prompt cache's chunks, restored while others decode) and
    requests that share nothing, of every budget."""
    system = "Answer with the count of the words, then spell it. " * 2
    reqs = [
        ("/v1/chat/completions", chat(f"How many words: {'a b ' * (i % 7)}?", system, model=MODEL, max_tokens=4 + i))
        for i in range(10)
    ]
    reqs += [
        ("/v1/completions", {"model": MODEL, "prompt": f"List {i} items:", "max_tokens": 30 - i}) for i in range(8)
    ]
    return reqs


def test_sixteen_clients_at_once_batched(folder, tmp_path):
    """test_serve.py's load test with batching on: 16 clients, 96 requests of mixed kinds: none lost, no 5xx, one
    ledger line each, `verify` passes, every response the request's alone (computed first, one at a time)."""
    d = _copy(folder, tmp_path)
    reqs = _mixed()
    s = start(d, "-m", "serve.yaml", "--batch", "8", "--queue", "256", env=folder[1])
    try:
        alone = [_send(s, p, b)[:3] for p, b in reqs]
        jobs = [i % len(reqs) for i in range(96)]
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda i: (i, _send(s, *reqs[i])), jobs))
        batch = _health(s)["batch"]
    finally:
        assert s.stop() == 0
    assert batch["rows"] > batch["steps"]
    for i, o in got:
        assert o[:3] == alone[i]
    lines = ledger_lines(d / "kvgraft-ledger.jsonl")
    assert len(lines) == len(reqs) + len(jobs) and all(e["kind"] == "serve" for e in lines)
    assert sorted(o[3] for _, o in got) == [e["seq"] for e in lines[len(reqs) :]]
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=d, env=folder[1], check_rc=0)


def _four_decoding(folder: tuple[Path, dict], d: Path):
    """A server on a folder of its own with four requests decoding together (three plain, one streaming); None
    (everything stopped) when they did not meet: on a loaded machine one may finish its 200 tokens before the last
    joins. (server, threads, results, stream)."""
    _copy(folder, d)
    s = start(d, "-m", "serve.yaml", "--batch", "4", env=folder[1])
    results: list = []
    bodies = [{"model": MODEL, "prompt": f"Count {i}:", "max_tokens": 200} for i in range(3)]
    threads = [
        threading.Thread(target=lambda b=b: results.append(s.request("POST", "/v1/completions", b))) for b in bodies
    ]
    client = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(**chat("Go on and on.", model=MODEL, max_tokens=200), stream=True)
    for t in threads:
        t.start()
    next(iter(stream))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        decoding = _health(s)["batch"]["decoding"]
        if decoding == 4:  # all four in one batch
            return s, threads, results, stream
        if results:  # one has finished: the four can no longer meet
            break
        time.sleep(0.01)
    stream.close()
    for t in threads:
        t.join(60)
    s.stop()
    return None


def test_a_client_gone_and_sigterm_mid_batch_lose_no_answered_request(folder, tmp_path):
    """Four requests decoding together: one client goes away mid-stream (its decode stops, its line says
    "cancelled"), the others go on; SIGTERM while they decode drains them: each answered in full, one ledger line
    each, `verify` passes."""
    for attempt in range(3):  # the four must meet in one batch first (_four_decoding): up to 3 servers
        d = tmp_path / f"try{attempt}"
        met = _four_decoding(folder, d)
        if met is not None:
            break
    assert met is not None, "four requests never decoded together in 3 tries"
    s, threads, results, stream = met
    deadline = time.monotonic() + 60
    stream.close()  # the client goes away mid-batch
    while not ledger_lines(d / "kvgraft-ledger.jsonl") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.stop(signal.SIGTERM) == 0  # the three others still decoding
    for t in threads:
        t.join(60)
    assert [st for st, _, _ in results] == [200, 200, 200]
    lines = ledger_lines(d / "kvgraft-ledger.jsonl")
    assert len(lines) == 4
    assert lines[0]["outputs"]["finish_reason"] == "cancelled"
    assert lines[0]["outputs"]["costs"]["decode_tokens"] < 200
    answered = {json.loads(b)["kvgraft"]["ledger"]["seq"] for _, _, b in results}
    assert answered == {e["seq"] for e in lines[1:]}
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=d, env=folder[1], check_rc=0)


def test_solve_batched_writes_a_one_at_a_time_runs_outputs_and_ledger(folder, tmp_path):
    """`solve --compare` (the library's exact hits and misses, then the baseline) with --batch 1 and --batch 4 in
    two folders with the same library: the same outputs files, byte for byte, and the same ledger entries but their
    times."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines()[:10]))
    d1 = _copy(folder, tmp_path / "b1")
    run_cli("deposit", str(problems), "-m", "serve.yaml", "--limit", "4", cwd=d1, env=folder[1], check_rc=0)
    shutil.copytree(d1, tmp_path / "b4")  # the same library
    runs = {}
    for batch in ("1", "4"):
        d = tmp_path / f"b{batch}"
        p = run_cli(
            "solve", str(problems), "-m", "serve.yaml", "--compare", "--batch", batch, "--json", cwd=d, env=folder[1],
            check_rc=0,
        )  # fmt: skip
        runs[batch] = (d, json.loads(p.stdout))
    (d1, r1), (d4, r4) = runs["1"], runs["4"]
    assert (r1["library"]["batch"], r4["library"]["batch"], r4["baseline"]["batch"]) == (1, 4, 4)
    t = r4["library"]["totals"]
    assert t["exact_hits"] >= 2 and t["problems"] - t["exact_hits"] >= 2  # both kinds decoded together
    for mode, name in (("library", "problems.solve.jsonl"), ("baseline", "problems.baseline.jsonl")):
        assert (d1 / name).read_bytes() == (d4 / name).read_bytes()
        assert r1[mode]["outputs_sha256"] == r4[mode]["outputs_sha256"]
    solves = lambda d: [e for e in ledger_lines(d / "kvgraft-ledger.jsonl") if e["kind"].startswith("solve")]  # noqa: E731
    one, four = solves(d1), solves(d4)
    assert [e["kind"] for e in one] == [e["kind"] for e in four] and len(one) == 2 * (t["problems"] + 1)
    for a, b in zip(one, four):
        if a["kind"] == "solve-outputs":
            for e in (a, b):
                for k in TIMING:
                    e["outputs"]["totals"].pop(k, None)
        assert _line_but_times(a) == _line_but_times(b)
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=d4, env=folder[1], check_rc=0)
