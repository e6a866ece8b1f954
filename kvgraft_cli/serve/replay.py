"""`kvgraft replay --served LEDGER`: compute every request a server answered again, and compare every hash.

Each ``serve`` line names its request's body by hash and the requests log that holds it (beside the ledger). The
replay parses each body again (its hash must match), computes it on a fresh engine with the prompt cache off (every
prompt from position 0, as a cold server would: a response never depends on the cache, so this is the strongest
comparison), and compares the prompt's token ids, the first token's logits, the generated ids and the text. A
cancelled request is compared on what it decoded before it stopped: a prefix of the replayed decode. The library
is read, never written; a question that was a miss and is a hit now (or the other way) is a mismatch named so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.manifest import Manifest
from ..engine.engine import Engine, token_ids_sha256
from ..errors import InputError
from ..ledger import entries
from ..ledger.entries import ReplayServedEntry, ServeEntry
from ..runs.context import RunContext, engine_facts
from ..runs.replay import Prereg, file_check, request_bodies
from ..util.hashing import canonical_json, sha256_bytes
from ..util.limits import read_lines
from .answer import KIND, Options, Server
from .protocol import RequestError, parse


@dataclass
class Compared:
    """One served request replayed: the ledger line, what differed (empty: every hash matched)."""

    seq: int
    endpoint: str
    hit: str
    finish_reason: str
    mismatches: list[str] = field(default_factory=list)

    @property
    def matched(self) -> bool:
        return not self.mismatches


@dataclass
class ServedReplay:
    ledger: str
    rows: list[Compared] = field(default_factory=list)
    ledger_seq: int | None = None

    @property
    def mismatched(self) -> int:
        return sum(not r.matched for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger,
            "requests": len(self.rows),
            "matched": len(self.rows) - self.mismatched,
            "mismatched": self.mismatched,
            "ledger_seq": self.ledger_seq,
            "rows": [
                {
                    "seq": r.seq,
                    "endpoint": r.endpoint,
                    "hit": r.hit,
                    "finish_reason": r.finish_reason,
                    "mismatches": r.mismatches,
                }  # fmt: skip
                for r in self.rows
            ],
        }


def served_entries(path: Path) -> list[ServeEntry]:
    """The ``serve`` lines of a ledger (InputError when there are none, or one is not what a serve line records)."""
    found = entries.read(path, (ServeEntry,))
    if not found:
        raise InputError(
            f"{path} holds no served requests (no `{KIND}` lines)", "name the ledger `kvgraft serve` wrote"
        )
    return found


def served_manifest(path: Path, served: list[ServeEntry]) -> Manifest:
    """The manifest the server ran, as its lines name it (``manifest.path``, relative to the ledger's folder, or the
    embedded one) and checked against the file hash they record; InputError when the lines name several or the file
    changed since."""
    from ..config.manifest import BUILTIN_PREFIX, DEFAULT_MANIFEST, load_manifest

    named = {(e.manifest.path or e.manifest.source, e.manifest.sha256) if e.manifest else None for e in served}
    if len(named) != 1:
        raise InputError(
            f"{path}: the served lines name {len(named)} manifests; a replay runs one",
            "split the ledger by manifest (`kvgraft ledger log --manifest ...`)",
        )
    if None in named:
        raise InputError(f"{path}: a served line records no manifest", f"run `kvgraft verify {path}`")
    ref, sha = named.pop()  # type: ignore[misc]
    m = load_manifest(None) if ref == BUILTIN_PREFIX + DEFAULT_MANIFEST else load_manifest(Path(path).parent / ref)
    if m.file_sha256 != sha:
        raise InputError(
            f"{path}: the server ran manifest {ref} with sha256 {sha[:16]}..., the file now has {m.file_sha256[:16]}...",
            "the manifest changed since: restore the one the server ran",
        )
    return m


def replay_served(
    ctx: RunContext,  # on served_manifest()'s manifest
    served_ledger: Path,
    engine: Engine,
    on_progress: Callable[[Compared], None] | None = None,
) -> ServedReplay:
    """Replay every served request of ``served_ledger`` (see the module docstring); appends one ``replay-served``
    line to the context's ledger with the counts and the hash of the lines replayed."""
    served = served_entries(served_ledger)
    bodies = request_bodies(served_ledger, served)
    report = ServedReplay(str(served_ledger))
    servers: dict[tuple, Server] = {}
    try:
        for e in served:
            settings = e.settings
            key = (settings.get("k", 0), settings.get("min_score"))
            if key not in servers:
                min_score = float(key[1]) if key[1] is not None else None
                servers[key] = Server(ctx, engine, Options(k=key[0], min_score=min_score, prompt_cache=False))
                servers[key].open()
            row = _compare(servers[key], e, bodies)
            report.rows.append(row)
            if on_progress:
                on_progress(row)
    finally:
        for s in servers.values():
            s.close()
    lines = b"".join(canonical_json(e.to_json()) + b"\n" for e in served)
    entry = ReplayServedEntry(
        manifest=ctx.manifest_ref(),
        **engine_facts(engine),
        served={
            "ledger": ctx.rel(Path(served_ledger)),
            "lines_sha256": sha256_bytes(lines),
            "first_seq": served[0].seq,
            "last_seq": served[-1].seq,
            "count": len(served),
        },
        matched=len(report.rows) - report.mismatched,
        mismatched=report.mismatched,
    )
    report.ledger_seq = entries.write(ctx.ledger, entry).seq
    return report


def _compare(server: Server, e: ServeEntry, bodies: dict[str, tuple[str, dict | None]]) -> Compared:
    row = Compared(e.lineno - 1, e.request.get("endpoint", "?"), str(e.library.get("hit")), e.finish_reason)
    found = bodies.get(e.request.sha256)
    if found is None:
        row.mismatches.append("request body not in the requests log")
        return row
    endpoint, body = found
    if body is None:
        row.mismatches.append("request body not kept (the server ran with --no-log-bodies): not computed again")
        return row
    try:
        req = parse(canonical_json(body), endpoint)
    except RequestError as err:
        row.mismatches.append(f"request no longer parses: {err.message}")
        return row
    if req.sha256 != e.request.sha256:
        row.mismatches.append("request body hash")
        return row
    try:
        ans = server.answer(req, record=False)
    except RequestError as err:
        row.mismatches.append(f"request refused now: {err.message}")
        return row
    want_ids = e.generated_ids
    got = {
        "hit": ans.hit,
        "prompt ids": token_ids_sha256(ans.prompt_ids),
        "first-token logits": ans.first_logits_sha256,
    }
    expected = {
        "hit": e.library.get("hit"),
        "prompt ids": e.prompt_ids.sha256,
        "first-token logits": e.first_logits.sha256 if e.first_logits else None,
    }
    if e.finish_reason == "cancelled" and not isinstance(want_ids.get("count"), int):
        row.mismatches.append("the line records no count of the ids decoded before the cancel")
        return row
    if e.finish_reason == "cancelled":
        if expected["first-token logits"] is None:  # cancelled before any computation
            got.pop("first-token logits"), expected.pop("first-token logits")
        got["generated ids (the prefix decoded before the cancel)"] = token_ids_sha256(ans.ids[: want_ids.get("count")])
        expected["generated ids (the prefix decoded before the cancel)"] = want_ids.sha256
    else:
        got["generated ids"], expected["generated ids"] = token_ids_sha256(ans.ids), want_ids.sha256
        got["text"], expected["text"] = sha256_bytes(ans.text.encode()), e.output.sha256
        got["finish reason"], expected["finish reason"] = ans.finish_reason, e.finish_reason
    row.mismatches = [what for what in expected if got[what] != expected[what]]
    return row


def replay_served_run(ctx: RunContext, pr: Prereg, run: dict, get_engine: Callable[[], Engine]) -> dict[str, Any]:
    """The runner of a prereg's ``serve`` run (runs.replay): every request of its requests file computed again, as
    `replay --served` does (prompt cache off, the library read, never written), and the hashes the server recorded
    recomputed under the same names (``request i``, ``hit i``, ``prompt ids i``, ``first-token logits i``, ``generated
    ids i``, ``text i``, ``finish reason i``)."""
    path, sha = file_check(pr, run["requests"])
    got: dict[str, Any] = {"requests_sha256": sha}
    if sha != run["requests_sha256"]:
        return got
    s = run["settings"]
    min_score = float(s["min_score"]) if s["min_score"] is not None else None
    server = Server(ctx, get_engine(), Options(k=s["k"], min_score=min_score, prompt_cache=False))
    server.open()
    try:
        for i, (_, line) in enumerate(read_lines(path, "requests file"), 1):
            record = json.loads(line)
            try:
                req = parse(canonical_json(record["body"]), record["endpoint"])
                got[f"request {i}"] = req.sha256
                ans = server.answer(req, record=False)
            except RequestError as err:
                got[f"hit {i}"] = f"refused: {err.message}"
                continue
            got[f"hit {i}"] = ans.hit
            got[f"prompt ids {i}"] = token_ids_sha256(ans.prompt_ids)
            if ans.first_logits_sha256:
                got[f"first-token logits {i}"] = ans.first_logits_sha256
            got[f"generated ids {i}"] = token_ids_sha256(ans.ids)
            got[f"text {i}"] = sha256_bytes(ans.text.encode())
            got[f"finish reason {i}"] = ans.finish_reason
    finally:
        server.close()
    return got
