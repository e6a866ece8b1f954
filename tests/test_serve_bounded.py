"""`kvgraft serve` left running: a bounded prompt cache (--cache-max), API keys and tenants, /metrics.

Real servers on loopback (tests/serving.py), the embedded tiny model under chunks of 16 tokens, talked to by the
official openai client and plain HTTP. What is checked:
- a long run of distinct prompts from several clients on two servers sharing one store, the store's chunk files
  never over the bound by more than one chain, no answered request lost, the ledger verified and every request
  replayed (`replay --served`), an evicted prompt answered as it was first;
- kill -9 in the middle of an eviction (its transaction open, some files unlinked), then a server on that store
  answering as before, a missing chunk a miss;
- 401s in OpenAI's shape (the openai client's AuthenticationError), a key from a file and the environment,
  listening beyond loopback refused without a key;
- tenants: one tenant's chunks never a hit for another, nor for another cache_salt; library answers shared;
- /metrics parsed by prometheus_client's parser, its counts those of the requests sent;
- the requests log owner-only, and --no-log-bodies keeping hashes only (replay says so).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml
from conftest import EXAMPLES, REPO, deposit_here, environ_without_pins, run_cli
from serving import Served, chat, ledger_lines, start

pytestmark = pytest.mark.xdist_group("serve-bounded")

MODEL = "tiny-serve"
CHUNK = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def _manifest(folder: Path) -> None:
    data = yaml.safe_load((REPO / "kvgraft_cli" / "data" / "default.yaml").read_text())
    data["name"] = MODEL
    data["prefill"] = {"schedule": "chunked", "chunk_size": CHUNK}
    data["decode"]["max_new_tokens"] = 8
    (folder / "serve.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _prompt(i: int) -> str:
    """A distinct prompt of 40 to 50 tokens (the tiny model's tokens are characters: two full chunks and a rest):
    the words of ``i`` in base 19."""
    words, n = [], i
    for _ in range(4):
        words.append(WORDS[n % len(WORDS)])
        n //= len(WORDS)
    return f"Note {i}: " + " ".join(words) + " is the code."


def _complete(s: Served, prompt: str, key: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, _, data = s.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}, headers
    )
    assert status == 200, data
    return json.loads(data)


def _chunk_files(store: Path) -> dict[str, int]:
    """The store's prompt-chunk object files on disk and their sizes (what the bound is about)."""
    import sqlite3

    db = sqlite3.connect(store / "index.sqlite")
    try:
        others = {row[0] for row in db.execute("SELECT artifact FROM entries WHERE problem_id != 'serve-prompt-chunk'")}
    finally:
        db.close()
    out = {}
    for f in (store / "objects").glob("*/*.kvg"):
        if f.stem not in others:  # a library entry or deposit is not the cache's
            try:
                out[f.stem] = f.stat().st_size
            except FileNotFoundError:  # unlinked meanwhile
                pass
    return out


def _answer_of(d: dict) -> tuple:
    k = d["kvgraft"]
    return d["choices"][0]["text"], k["first_logits_sha256"], k["generated_ids_sha256"]


def test_a_bounded_cache_under_a_long_run_of_distinct_prompts(tmp_path):
    """150 distinct prompts from 6 clients on two servers sharing one store bounded at 160 KiB (about 5 chunks of
    this model): the chunk files on disk, sampled all along, never exceed the bound by more than one request's
    chain per server; every request is answered and recorded; the ledger verifies; replay --served matches every
    line; a prompt evicted long ago is answered as the first time."""
    _manifest(tmp_path)
    bound = 160 << 10
    a = start(tmp_path, "-m", "serve.yaml", "--cache-max", "160K", "--queue", "64")
    b = start(tmp_path, "-m", "serve.yaml", "--cache-max", "160K", "--queue", "64")
    n, clients = 150, 6
    first = {}
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], sum(_chunk_files(tmp_path / "kvgraft-store").values()))
            time.sleep(0.05)

    def client(c: int) -> None:
        s = a if c % 2 == 0 else b
        for i in range(c, n, clients):
            d = _complete(s, _prompt(i))
            if i < 12:
                first[i] = _answer_of(d)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        # The first 12 prompts alone, one after another: their answers are the cold ones to compare with at the end
        for i in range(12):
            first[i] = _answer_of(_complete(a, _prompt(i)))
        chunk_size = set(_chunk_files(tmp_path / "kvgraft-store").values())
        watcher.start()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        done.set()
        watcher.join()
        again = {i: _answer_of(_complete(b, _prompt(i))) for i in range(12)}
        health = json.loads(a.request("GET", "/health")[2])
    finally:
        done.set()
        assert a.stop() == 0 and b.stop() == 0
    lines = [e for e in ledger_lines(tmp_path / "kvgraft-ledger.jsonl") if e["kind"] == "serve"]
    # One chain: the most chunks a request deposited, each a full chunk of 16 tokens (the same bytes each)
    chain = max(len(e["inputs"]["prompt_cache"]["deposited"]) for e in lines) * max(chunk_size)
    assert 0 < chain < bound
    assert peak[0] <= bound + 2 * chain, (peak[0], bound, chain)  # two servers: each at most one chain over
    final = sum(_chunk_files(tmp_path / "kvgraft-store").values())
    assert final <= bound, final
    assert health["prompt_cache"]["max_bytes"] == bound and health["prompt_cache"]["evicted_chunks"] > 50
    assert again == {i: first[i] for i in range(12)}  # evicted long ago: computed cold again, the same bits
    assert len(lines) == 12 + n + 12  # nothing answered is missing
    assert sum(len(e["inputs"]["prompt_cache"]["deposited"]) for e in lines) > 250
    verified = json.loads(run_cli("verify", "kvgraft-ledger.jsonl", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert verified["passed"] and verified["files"]["missing"] == []  # an evicted chunk is no missing record
    named = {s for e in lines for s in e["inputs"]["prompt_cache"]["chunks"] + e["inputs"]["prompt_cache"]["deposited"]}
    kept = set(_chunk_files(tmp_path / "kvgraft-store"))
    assert verified["prompt_cache"] == {
        "named": len(named),
        "in_store": len(named & kept),
        "not_in_store": len(named - kept),
        "not_checked": 0,
    }
    assert len(named - kept) > 250
    p = run_cli("replay", "--served", "kvgraft-ledger.jsonl", "--json", cwd=tmp_path, check_rc=0)
    replay = json.loads(p.stdout)
    assert replay["matched"] == len(lines) and replay["mismatched"] == 0


_EVICT_AND_HANG = """
import sys, os, time
from pathlib import Path
from kvgraft_cli.store import eviction
from kvgraft_cli.store.local import Store

drop = eviction._drop
calls = []

def slow_drop(store, key, artifact):
    out = drop(store, key, artifact)
    calls.append(key)
    if len(calls) == 3:  # three chunks' rows deleted and files unlinked, the transaction still open
        Path(sys.argv[2]).write_text("mid-eviction")
        time.sleep(600)
    return out

eviction._drop = slow_drop
eviction.evict(Store(Path(sys.argv[1])), 0)
"""


def test_kill_9_in_the_middle_of_an_eviction_then_a_restart_serves_the_same(tmp_path):
    """An eviction killed with SIGKILL after unlinking three chunk files, its transaction open: the index rolls back
    (rows naming files that are gone), and a server started on the store answers every prompt as before, each
    missing chunk a miss (computed, not refused), the ledger verified."""
    _manifest(tmp_path)
    s = start(tmp_path, "-m", "serve.yaml", "--cache-max", "none")
    try:
        before = {i: _answer_of(_complete(s, _prompt(i))) for i in range(6)}
    finally:
        assert s.stop() == 0
    store = tmp_path / "kvgraft-store"
    files = _chunk_files(store)
    flag = tmp_path / "flag"
    proc = subprocess.Popen(
        [sys.executable, "-c", _EVICT_AND_HANG, str(store), str(flag)], env=environ_without_pins(), cwd=tmp_path
    )
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the eviction did not start"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    gone = set(files) - set(_chunk_files(store))
    assert len(gone) == 3  # unlinked...
    import sqlite3

    db = sqlite3.connect(store / "index.sqlite")
    try:
        rows = {r[0] for r in db.execute("SELECT artifact FROM entries WHERE problem_id = 'serve-prompt-chunk'")}
    finally:
        db.close()
    assert gone <= rows  # ...and their rows still there: the eviction's transaction rolled back
    s = start(tmp_path, "-m", "serve.yaml", "--cache-max", "none")
    try:
        after = {i: _complete(s, _prompt(i)) for i in range(6)}
        again = {i: _complete(s, _prompt(i)) for i in range(6)}
    finally:
        assert s.stop() == 0
    assert {i: _answer_of(d) for i, d in after.items()} == before
    assert {i: _answer_of(d) for i, d in again.items()} == before
    for d in [*after.values(), *again.values()]:
        assert "refused" not in json.dumps(d["kvgraft"]["prompt_cache"])
    lines = [e for e in ledger_lines(tmp_path / "kvgraft-ledger.jsonl") if e["kind"] == "serve"]
    assert all(not e["inputs"]["prompt_cache"]["refused"] for e in lines)
    assert set(_chunk_files(store)) >= set(files)  # the missing chunks were deposited again
    assert all(d["kvgraft"]["cached_tokens"] > 0 for d in again.values())  # and are hits now
    run_cli("verify", "kvgraft-ledger.jsonl", cwd=tmp_path, check_rc=0)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, engine):
    """A server with two keys (one on the command line, one from a file) and one more from the environment, on a
    store whose library holds the first 4 examples."""
    d = tmp_path_factory.mktemp("keyed")
    _manifest(d)
    (d / "problems.jsonl").write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines()[:4]))
    deposit_here(engine, d, "problems.jsonl", manifest="serve.yaml")
    (d / "keys.txt").write_text("# tenants\nkey-of-bob\n\n")
    s = start(
        d,
        "-m",
        "serve.yaml",
        "--api-key",
        "key-of-alice",
        "--api-key-file",
        "keys.txt",
        env={"KVGRAFT_API_KEY": "key-of-carol"},
    )
    yield s
    s.stop()


def _client(s: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base, api_key=key, max_retries=0, timeout=120)


def test_keys_are_checked_and_refusals_are_401s_in_openais_shape(keyed):
    with pytest.raises(openai.AuthenticationError) as refused:
        _client(keyed, "key-of-mallory").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert refused.value.status_code == 401
    assert refused.value.body["code"] == "invalid_api_key" and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "key-of-alic").models.list()  # a prefix of a key is no key
    status, headers, body = keyed.request("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    for key in ("key-of-alice", "key-of-bob", "key-of-carol"):
        out = _client(keyed, key).completions.create(model=MODEL, prompt="Say hi.", max_tokens=2)
        assert out.choices[0].finish_reason in ("stop", "length")
    status, _, body = keyed.request("GET", "/health")  # open, as vLLM's is
    assert status == 200 and json.loads(body)["api_keys"] == 3


def test_one_tenants_prompt_cache_is_never_anothers(keyed):
    """The same prompt: alice's second request restores her chunks; bob's first, and alice's under another
    cache_salt, restore nothing (cold), with the same answer bits; the ledger names each line's tenant by a hash.
    A library question is an exact hit for every tenant (verified answers are shared)."""
    prompt = "A shared system prompt, long enough for several chunks of sixteen tokens each. " * 3 + "Question 7?"
    alice = [_complete(keyed, prompt, "key-of-alice") for _ in range(2)]
    bob = _complete(keyed, prompt, "key-of-bob")
    salted = _complete(keyed, prompt, "key-of-alice", cache_salt="project-2")
    salted_again = _complete(keyed, prompt, "key-of-alice", cache_salt="project-2")
    assert alice[0]["kvgraft"]["cached_tokens"] == 0 and alice[1]["kvgraft"]["cached_tokens"] > 0
    assert bob["kvgraft"]["cached_tokens"] == 0 and bob["kvgraft"]["prompt_cache"]["chunks"] == []
    # objects of their own: no file or verified memory shared, so bob's warm time says nothing of alice's prompts
    assert not set(bob["kvgraft"]["prompt_cache"]["deposited"]) & set(alice[0]["kvgraft"]["prompt_cache"]["deposited"])
    assert salted["kvgraft"]["cached_tokens"] == 0 and salted_again["kvgraft"]["cached_tokens"] > 0
    answers = {_answer_of(d) for d in [*alice, bob, salted, salted_again]}
    assert len(answers) == 1  # cold or warm, whoever asks: the same bits
    lines = [e for e in ledger_lines(keyed.folder / "kvgraft-ledger.jsonl") if e["kind"] == "serve"]
    tenants = {e["inputs"]["request"].get("tenant") for e in lines[-5:]}
    assert len(tenants) == 2 and None not in tenants
    assert not any("key-of" in json.dumps(e) for e in lines)  # keys are never written
    question = json.loads(EXAMPLES.read_text().splitlines()[0])["problem"]
    for key in ("key-of-alice", "key-of-bob"):
        status, _, body = keyed.request(
            "POST",
            "/v1/chat/completions",
            chat(question, model=MODEL),
            {"Authorization": f"Bearer {key}"},
        )
        assert status == 200 and json.loads(body)["kvgraft"]["hit"] == "exact"


def test_metrics_count_what_was_served(keyed):
    """/metrics in Prometheus' text format (prometheus_client's parser reads it): the requests, tokens, cache
    chunks and library hits the responses reported since the last scrape, 401s by status."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, tuple], float]:
        status, headers, body = keyed.request("GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode())
            for s in fam.samples
        }

    before = scrape()
    sent = [_complete(keyed, _prompt(1000 + i % 3), "key-of-bob") for i in range(6)]
    keyed.request("GET", "/v1/models")  # a 401
    after = scrape()

    def delta(name: str, **labels) -> float:
        k = (name, tuple(sorted(labels.items())))
        return after.get(k, 0.0) - before.get(k, 0.0)

    assert delta("kvgraft_requests_total", outcome="length") + delta("kvgraft_requests_total", outcome="stop") == 6
    assert delta("kvgraft_prompt_tokens_total") == sum(d["usage"]["prompt_tokens"] for d in sent)
    assert delta("kvgraft_generation_tokens_total") == sum(d["usage"]["completion_tokens"] for d in sent)
    assert delta("kvgraft_prompt_cache_hits_total") == sum(len(d["kvgraft"]["prompt_cache"]["chunks"]) for d in sent)
    assert delta("kvgraft_prompt_cache_misses_total") == sum(
        len(d["kvgraft"]["prompt_cache"]["deposited"]) for d in sent
    )
    assert delta("kvgraft_prompt_cache_hits_total") > 0 and delta("kvgraft_prompt_cache_misses_total") > 0
    assert delta("kvgraft_request_errors_total", status="401") == 1
    assert delta("kvgraft_time_to_first_token_seconds_count") == 6
    assert after[("kvgraft_queue_depth", ())] == 0
    assert after[("kvgraft_prompt_cache_max_bytes", ())] == 8 << 30  # the default bound


def test_listening_beyond_loopback_needs_a_key_or_says_it_is_meant(tmp_path):
    _manifest(tmp_path)
    p = run_cli("serve", "-m", "serve.yaml", "--host", "0.0.0.0", "--port", "0", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("Error: --host 0.0.0.0 listens beyond this machine")
    assert "--no-api-key" in p.stderr and not (tmp_path / "kvgraft-ledger.jsonl").exists()
    (tmp_path / "keys.txt").write_text("a key with spaces\n")
    p = run_cli("serve", "-m", "serve.yaml", "--api-key-file", "keys.txt", cwd=tmp_path)
    assert p.returncode == 2 and "keys.txt:1" in p.stderr


def test_the_requests_log_is_the_owners_and_can_keep_hashes_only(tmp_path):
    _manifest(tmp_path)
    s = start(tmp_path, "-m", "serve.yaml", "--no-log-bodies")
    try:
        _complete(s, "What is one and one?")
    finally:
        assert s.stop() == 0
    log = tmp_path / "kvgraft-ledger.requests.jsonl"
    assert log.stat().st_mode & 0o777 == 0o600
    assert "one and one" not in log.read_text() and json.loads(log.read_text())["body_kept"] is False
    p = run_cli("replay", "--served", "kvgraft-ledger.jsonl", cwd=tmp_path)
    assert p.returncode == 1 and "--no-log-bodies" in p.stdout + p.stderr
