"""`kvgraft serve` as users meet it: a process on a loopback port, talked to by the official openai client and by
plain HTTP (tests/serving.py). The embedded tiny model under a chunked schedule (chunks of 16 tokens, so prompts
of a few dozen tokens already cross several chunk boundaries); the real model's serving test is in test_gguf.py.

What is checked: the endpoints and their shapes (streaming included), greedy-only refusals naming the field,
the library's exact hits (the same token ids as `kvgraft solve`), responses byte-independent of the prompt cache
(cold, warm, after a restart, with a damaged chunk, and with the cache off), one ledger line per answered request
that `kvgraft verify` passes, bad input refused with nothing written, 16 concurrent clients, a bounded queue (429),
cancellation on disconnect, SIGTERM draining, kill -9, and that the server listens on loopback only.
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
from conftest import EXAMPLES, REPO, deposit_here, run_cli
from loopback import assert_loopback_only, listeners, with_descendants
from serving import Served, chat, ledger_lines, start

pytestmark = pytest.mark.xdist_group("serve")  # one worker deposits once and runs the servers

MODEL = "tiny-serve"
CHUNK = 16
SYSTEM = "You answer arithmetic questions. Show the work, then the answer. " * 6  # several chunks long


def _manifest(folder: Path) -> Path:
    data = yaml.safe_load((REPO / "kvgraft_cli" / "data" / "default.yaml").read_text())
    data["name"] = MODEL
    data["prefill"] = {"schedule": "chunked", "chunk_size": CHUNK}
    data["decode"]["max_new_tokens"] = 12
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory, engine):
    """A folder with the tiny model's chunked manifest, the first 4 examples deposited (the library; in this
    process), and `kvgraft solve` run once on them (what the server's exact hits must reproduce)."""
    d = tmp_path_factory.mktemp("serve")
    _manifest(d)
    (d / "problems.jsonl").write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines()[:4]))
    deposit_here(engine, d, "problems.jsonl", manifest="serve.yaml")
    run_cli("solve", "problems.jsonl", "-m", "serve.yaml", "-o", "solved.jsonl", cwd=d, check_rc=0)
    return d


@pytest.fixture(scope="module")
def server(folder):
    s = start(folder, "-m", "serve.yaml", "--queue", "256")
    yield s
    s.stop()


def _problems() -> list[dict]:
    return [json.loads(line) for line in EXAMPLES.read_text().splitlines()]


def _client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=120)


def _mixed_requests() -> list[tuple[str, dict]]:
    """Requests of every kind the server computes: library questions (exact hits), questions it does not hold,
    chats with a shared system prompt (the prompt cache), completions whose lengths fall on, before and after chunk
    boundaries, streaming and not."""
    problems = _problems()
    reqs: list[tuple[str, dict]] = []
    for i, p in enumerate(problems[:4]):
        reqs.append(("/v1/chat/completions", chat(p["problem"], model=MODEL, stream=i % 2 == 1)))
    for p in problems[4:10]:
        reqs.append(("/v1/chat/completions", chat(p["problem"], model=MODEL, max_tokens=6)))
        shared = {"model": MODEL, "prompt": f"{SYSTEM}\nQuestion: {p['problem']}\nAnswer:", "max_tokens": 5}
        reqs.append(("/v1/completions", shared))
    base = "Problem: " + " ".join(p["problem"] for p in problems[:6])
    for cut in (15, 16, 17, 31, 32, 33, 47, 48, 49, 70, 95, 130):
        reqs.append(("/v1/completions", {"model": MODEL, "prompt": base[: cut * 3], "max_tokens": 4}))
    reqs.append(("/v1/completions", {"model": MODEL, "prompt": base, "max_tokens": 8, "stop": ["\n"]}))
    return reqs


def _send(s: Served, path: str, body: dict) -> dict:
    """A request's outcome as the client sees it: the text, and the hashes the server says it computed."""
    if body.get("stream"):
        client = _client(s)
        text, last = "", None
        for chunk in client.chat.completions.create(**body):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                last = chunk
        assert last is not None and last.model_extra is not None
        k = last.model_extra["kvgraft"]
        return {"text": text, "first": k["first_logits_sha256"], "ids": k["generated_ids_sha256"], "kvgraft": k}
    status, data = s.post(path, body)
    assert status == 200, data
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    k = data["kvgraft"]
    return {"text": text, "first": k["first_logits_sha256"], "ids": k["generated_ids_sha256"], "kvgraft": k}


def _outcomes(s: Served, reqs) -> list[tuple[str, str, str]]:
    return [(o["text"], o["first"], o["ids"]) for o in (_send(s, p, b) for p, b in reqs)]


# -- the endpoints ------------------------------------------------------------------------------------------------


def test_openai_client_chat_completion_models_and_streaming(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    q = chat("What is 12 times 12?", model=MODEL, max_tokens=8)
    r = client.chat.completions.create(**q)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None and u.completion_tokens == 8 and u.total_tokens == u.prompt_tokens + 8
    streamed, usage, last = "", None, None
    for chunk in client.chat.completions.create(**q, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            last = chunk
        else:
            usage = chunk.usage
    assert streamed == r.choices[0].message.content  # the pieces joined are the whole answer
    assert usage is not None and usage.completion_tokens == u.completion_tokens
    assert last is not None and last.choices[0].finish_reason == r.choices[0].finish_reason
    k = r.model_extra["kvgraft"]
    assert last.model_extra["kvgraft"]["generated_ids_sha256"] == k["generated_ids_sha256"]
    c = client.completions.create(model=MODEL, prompt="Problem: 2 + 2 =", max_tokens=5)
    assert c.object == "text_completion" and c.usage is not None and c.usage.completion_tokens <= 5
    streamed = "".join(
        x.choices[0].text
        for x in client.completions.create(model=MODEL, prompt="Problem: 2 + 2 =", max_tokens=5, stream=True)
    )
    assert streamed == c.choices[0].text
    with pytest.raises(openai.BadRequestError, match="no chat template"):  # a text-format model: one user turn
        client.chat.completions.create(**chat("hi", system=SYSTEM, model=MODEL))
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_an_exact_hit_answers_as_solve_does(server, folder):
    """A library question is grafted from its verified solution: the token ids `kvgraft solve` decoded for it."""
    solved = {
        e["inputs"]["record"]["id"]: e for e in ledger_lines(folder / "kvgraft-ledger.jsonl") if e["kind"] == "solve"
    }
    for p in _problems()[:4]:
        status, data = server.post("/v1/chat/completions", chat(p["problem"], model=MODEL))
        assert status == 200, data
        k = data["kvgraft"]
        assert k["hit"] == "exact" and k["grafted_tokens"] > 0 and len(k["artifacts"]) == 1
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= k["grafted_tokens"]
        assert k["generated_ids_sha256"] == solved[p["id"]]["outputs"]["generated_ids"]["sha256"]
        assert k["artifacts"] == solved[p["id"]]["inputs"]["library"]["artifacts"]


def test_greedy_only_and_bad_input_are_refused_naming_the_field(server):
    ledger = server.folder / "kvgraft-ledger.jsonl"
    log = server.folder / "kvgraft-ledger.requests.jsonl"
    before = (len(ledger_lines(ledger)), log.read_bytes() if log.exists() else b"")
    q = chat("hi", model=MODEL)
    cases = [
        ({**q, "temperature": 0.7}, 400, "temperature"),
        ({**q, "top_p": 0.5}, 400, "top_p"),
        ({**q, "n": 2}, 400, "n"),
        ({**q, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({**q, "logprobs": True}, 400, "logprobs"),
        ({**q, "frobnicate": 1}, 400, "frobnicate"),
        ({**q, "model": "gpt-4"}, 404, "model"),
        ({**q, "messages": []}, 400, "messages"),
        ({**q, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
        ({**q, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ({**q, "max_tokens": 0}, 400, "max_tokens"),
        ({**q, "max_tokens": 40000}, 400, "messages"),  # past the model's 32,768 positions
        ({**q, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({**q, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ]
    client = _client(server)
    for body, status, param in cases:
        got, data = server.post("/v1/chat/completions", body)
        assert (got, data["error"]["param"]) == (status, param), (body, data)
        assert data["error"]["message"] and data["error"]["type"]
    with pytest.raises(openai.BadRequestError, match="temperature"):  # the official client raises it as such
        client.chat.completions.create(**q, temperature=1.0)
    with pytest.raises(openai.BadRequestError, match="context"):  # refused before streaming: an HTTP 400 too
        client.completions.create(model=MODEL, prompt="word " * 200_000, stream=True)
    status, data = server.post("/v1/chat/completions", b'{"model": "tiny-serve", "messages": [')
    assert status == 400 and data["error"]["code"] == "invalid_json"
    status, _, body = server.request("POST", "/v1/chat/completions", b'{"x": "' + b"a" * (2 << 20) + b'"}')
    assert status == 413 and json.loads(body)["error"]["code"] == "too_large"
    status, data = server.post("/v1/completions", {"model": MODEL, "prompt": "word " * 200_000})
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    status, _, _ = server.request("GET", "/v1/nothing")
    assert status == 404
    assert (len(ledger_lines(ledger)), log.read_bytes() if log.exists() else b"") == before  # nothing written


# -- exactness: a response never depends on the cache's state ------------------------------------------------------


def test_responses_do_not_depend_on_the_prompt_cache(folder, tmp_path):
    """The same requests (every kind) give the same text, first-token logits and token ids cold (an empty cache),
    warm, and after a restart on a copy of the store (chunks another server deposited, read from disk, one of them
    damaged: refused, recomputed, named in the ledger); `replay --served` computes them all again with the cache
    off and compares every hash."""
    reqs = _mixed_requests()
    work = tmp_path / "w"
    work.mkdir()
    shutil.copy(folder / "serve.yaml", work)
    shutil.copytree(folder / "kvgraft-store", work / "kvgraft-store")  # the library, no prompt chunks yet
    s = start(work, "-m", "serve.yaml")
    try:
        cold = _outcomes(s, reqs)
        warm = _outcomes(s, reqs)
    finally:
        assert s.stop() == 0  # SIGTERM: drained, exit 0
    entries = ledger_lines(work / "kvgraft-ledger.jsonl")
    assert warm == cold and len(entries) == 2 * len(reqs)
    assert sum(e["outputs"]["costs"]["cached_tokens"] for e in entries[len(reqs) :]) > 0  # warm did use the cache
    assert {e["inputs"]["library"]["hit"] for e in entries} == {"exact", "none", "plain"}
    other = tmp_path / "other"
    shutil.copytree(work, other)
    victim = next(c for e in entries for c in e["inputs"]["prompt_cache"]["chunks"])
    path = other / "kvgraft-store" / "objects" / victim[:2] / f"{victim}.kvg"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # one bit of a tensor flipped
    path.write_bytes(bytes(data))
    s = start(other, "-m", "serve.yaml", "--ledger", "other.jsonl")
    try:
        # At start the server read the newest prompt chains into memory, each chunk re-hashed: the damaged one's
        # chain was refused there too
        warmed = json.loads(s.request("GET", "/health")[2])["prompt_cache_warmed"]
        assert warmed["chunks"] > 0 and warmed["refused"] >= 1
        assert _outcomes(s, reqs) == cold
    finally:
        s.stop()
    restarted = ledger_lines(other / "other.jsonl")
    assert sum(e["outputs"]["costs"]["cached_tokens"] for e in restarted) > 0  # chunks read from disk
    assert [victim] in [e["inputs"]["prompt_cache"]["refused"] for e in restarted]
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=work, check_rc=0)
    # `replay --served`: every request of the cold and warm log computed again, cache off, every hash compared
    p = run_cli("replay", "--served", "kvgraft-ledger.jsonl", "--json", cwd=work, check_rc=0)
    assert json.loads(p.stdout)["matched"] == 2 * len(reqs)
    # A pre-registration made from the served log (its last 8 lines: every kind is replayed above already):
    # replayed, every recorded hash matches; a request file edited after the prereg pinned it is a failed check
    run_cli("prereg", "make", "kvgraft-ledger.jsonl", "--target", "here", "-o", "served.yaml",
            "--from-seq", str(2 * len(reqs) - 8), cwd=work, check_rc=0)  # fmt: skip
    requests = work / "served.serve-1.requests.jsonl"
    assert len(requests.read_text().splitlines()) == 8
    run_cli("replay", "--register", "served.yaml", cwd=work, check_rc=0)
    p = run_cli("replay", "served.yaml", "--json", cwd=work, check_rc=0)
    replayed = json.loads(p.stdout)
    assert replayed["passed"] and replayed["mismatched"] == 0
    whats = {c["what"] for c in replayed["comparisons"]}
    assert {"first-token logits 8", "generated ids 8", "text 8", "requests_sha256"} <= whats
    lines = requests.read_text().splitlines()
    first = json.loads(lines[0])
    first["body"]["max_tokens"] = 3
    requests.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    p = run_cli("replay", "served.yaml", "--json", cwd=work, check_rc=1)
    assert [c["what"] for c in json.loads(p.stdout)["comparisons"] if c["what"] == "requests_sha256" and not c["match"]]
    log = work / "kvgraft-ledger.requests.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for r in records:
        if r["sha256"] == records[0]["sha256"]:
            r["body"]["max_tokens"] = 3  # another request than the one the ledger names
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    p = run_cli("replay", "--served", "kvgraft-ledger.jsonl", cwd=work, check_rc=1)
    assert "line 1 " in p.stderr and "request body hash" in p.stderr


def test_sixteen_clients_at_once(server, folder):
    """16 concurrent clients, 208 requests: none lost, no 5xx, one ledger line each, `verify` passes, and every
    response byte-equal to the same request computed alone."""
    reqs = _mixed_requests()
    alone = dict(zip(range(len(reqs)), _outcomes(server, reqs)))
    ledger = folder / "kvgraft-ledger.jsonl"
    start_seq = len(ledger_lines(ledger))
    jobs = [i % len(reqs) for i in range(208)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: (i, _send(server, *reqs[i])), jobs))
    for i, o in got:
        assert (o["text"], o["first"], o["ids"]) == alone[i]
    new = ledger_lines(ledger)[start_seq:]
    assert len(new) == len(jobs) and all(e["kind"] == "serve" for e in new)
    assert sorted(o["kvgraft"]["ledger"]["seq"] for _, o in got) == [e["seq"] for e in new]
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=folder, check_rc=0)


def test_listens_on_loopback_only(server, folder, tmp_path):
    found = listeners(with_descendants([server.proc.pid]))
    assert_loopback_only(found, "kvgraft serve")
    assert server.port in {x.port for x in found}
    shutil.copy(folder / "serve.yaml", tmp_path)
    exposed = start(tmp_path, "-m", "serve.yaml", "--host", "0.0.0.0", "--no-api-key")  # the check goes red on this one
    try:
        with pytest.raises(AssertionError, match="listens off loopback"):
            assert_loopback_only(listeners(with_descendants([exposed.proc.pid])), "kvgraft serve --host 0.0.0.0")
    finally:
        exposed.stop()


# -- under load and faults -----------------------------------------------------------------------------------------


def _long(i: int) -> dict:
    return {"model": MODEL, "prompt": f"Problem {i}: count to a thousand.", "max_tokens": 3000}


def test_a_full_queue_answers_429_with_retry_after(folder, tmp_path):
    shutil.copy(folder / "serve.yaml", tmp_path)
    s = start(tmp_path, "-m", "serve.yaml", "--queue", "1", "--no-prompt-cache")
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: s.request("POST", "/v1/completions", _long(i)), range(6)))
    finally:
        s.stop()
    refused = [(h, json.loads(b)) for st, h, b in results if st == 429]
    assert refused, [st for st, _, _ in results]
    assert all(int(h["retry-after"]) >= 1 and e["error"]["code"] == "rate_limit_exceeded" for h, e in refused)
    assert {st for st, _, _ in results} == {200, 429}
    assert len(ledger_lines(tmp_path / "kvgraft-ledger.jsonl")) == sum(st == 200 for st, _, _ in results)


def test_a_client_that_disconnects_cancels_its_decode(folder, tmp_path, engine):
    shutil.copy(folder / "serve.yaml", tmp_path)
    s = start(tmp_path, "-m", "serve.yaml")
    try:
        client = _client(s)
        stream = client.chat.completions.create(
            **chat("Count to a thousand.", model=MODEL, max_tokens=20000), stream=True
        )
        next(iter(stream))
        stream.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 60
        while not ledger_lines(tmp_path / "kvgraft-ledger.jsonl") and time.monotonic() < deadline:
            time.sleep(0.1)
        # the server still answers others
        assert client.completions.create(model=MODEL, prompt="Problem: 1 + 1", max_tokens=2).choices
        # a library deposited while the server runs (it started with none) answers the next lookup
        p = _problems()[0]
        status, data = s.post("/v1/chat/completions", chat(p["problem"], model=MODEL))
        assert status == 200 and data["kvgraft"]["hit"] == "none"
        (tmp_path / "one.jsonl").write_text(json.dumps(p) + "\n")
        deposit_here(engine, tmp_path, "one.jsonl", manifest="serve.yaml")  # another process than the server's
        status, data = s.post("/v1/chat/completions", chat(p["problem"], model=MODEL))
        assert status == 200 and data["kvgraft"]["hit"] == "exact"
    finally:
        s.stop()
    entry = ledger_lines(tmp_path / "kvgraft-ledger.jsonl")[0]
    assert entry["outputs"]["finish_reason"] == "cancelled"
    assert entry["outputs"]["costs"]["decode_tokens"] < 20000


def test_sigterm_drains_the_requests_in_flight(folder, tmp_path):
    shutil.copy(folder / "serve.yaml", tmp_path)
    s = start(tmp_path, "-m", "serve.yaml")
    results: list = []
    body = {"model": MODEL, "prompt": "Problem: list the primes.", "max_tokens": 400}
    threads = [
        threading.Thread(target=lambda: results.append(s.request("POST", "/v1/completions", body))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not ledger_lines(tmp_path / "kvgraft-ledger.jsonl") and time.monotonic() < deadline:
        time.sleep(0.02)  # the first is answered, the others are in flight
    assert s.stop(signal.SIGTERM) == 0
    for t in threads:
        t.join(60)
    assert [st for st, _, _ in results] == [200, 200, 200]
    assert len(ledger_lines(tmp_path / "kvgraft-ledger.jsonl")) == 3
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=tmp_path, check_rc=0)


def test_after_kill_9_the_ledger_verifies_and_nothing_answered_is_missing(folder, tmp_path):
    shutil.copy(folder / "serve.yaml", tmp_path)
    s = start(tmp_path, "-m", "serve.yaml")
    answered: list[int] = []

    def client(i: int) -> None:
        for j in range(50):
            try:
                status, data = s.post(
                    "/v1/completions", {"model": MODEL, "prompt": f"Problem {i}.{j}:", "max_tokens": 20}
                )
            except OSError:
                return
            if status == 200:
                answered.append(data["kvgraft"]["ledger"]["seq"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while len(answered) < 10:
        time.sleep(0.01)
    s.stop(signal.SIGKILL)
    for t in threads:
        t.join(60)
    ledger = tmp_path / "kvgraft-ledger.jsonl"
    run_cli("ledger", "repair", "kvgraft-ledger.jsonl", cwd=tmp_path)  # at most a torn last line
    seqs = {e["seq"] for e in ledger_lines(ledger)}
    assert set(answered) <= seqs
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=tmp_path, check_rc=0)


def test_prompt_chunks_and_library_of_another_cpus_kernels_are_misses(tmp_path):
    """Under the native profile, a server on another CPU (KVGRAFT_CPUINFO: test_kernels.stand_in, which runs this
    machine's kernels, so the bits really are computed) deposits prompt chunks and a library into a store; a server
    here on the same store finds none of them (no library at start, no cached token) and computes the response
    itself, the same bytes; its own chunks are then found (red when prompt keys or library keys ignore the kernel
    identity)."""
    from test_kernels import stand_in

    data = yaml.safe_load(_manifest(tmp_path).read_text())
    data["runtime"]["env"] = {k: None for k in data["runtime"]["env"]}  # the native profile: kernels left to the CPU
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    other = tmp_path / "other.cpuinfo"
    other.write_text(stand_in()[0])
    there = {"KVGRAFT_CPUINFO": str(other)}
    (tmp_path / "problems.jsonl").write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    run_cli("deposit", "problems.jsonl", "-m", "serve.yaml", cwd=tmp_path, env=there, check_rc=0)
    req = {"model": MODEL, "prompt": f"{SYSTEM}\nQuestion: What is 7 plus 5?\nAnswer:", "max_tokens": 5}
    s = start(tmp_path, "-m", "serve.yaml", "--ledger", "there.jsonl", env=there)
    try:
        assert json.loads(s.request("GET", "/health")[2])["library"] is True
        first = _send(s, "/v1/completions", req)
    finally:
        s.stop()
    assert ledger_lines(tmp_path / "there.jsonl")[-1]["inputs"]["prompt_cache"]["deposited"]  # chunks were kept
    s = start(tmp_path, "-m", "serve.yaml", "--ledger", "here.jsonl")
    try:
        assert json.loads(s.request("GET", "/health")[2])["library"] is False
        cold, warm = (_send(s, "/v1/completions", req) for _ in range(2))
    finally:
        s.stop()
    here = ledger_lines(tmp_path / "here.jsonl")
    assert [e["outputs"]["costs"]["cached_tokens"] for e in here][0] == 0  # the other CPU's chunks: a miss
    assert here[1]["outputs"]["costs"]["cached_tokens"] > 0  # this CPU's own
    assert [(o["text"], o["first"], o["ids"]) for o in (cold, warm)] == [
        (first["text"], first["first"], first["ids"])
    ] * 2
