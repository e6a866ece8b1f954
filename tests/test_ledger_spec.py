"""An independent ledger verifier, written from docs/LEDGER.md alone, must agree with `kvgraft verify`.

The block between the two rulers is the verifier. It imports nothing from kvgraft: the standard library (hashlib,
json, base64, re, os), `zstandard` for artifact payloads and a pure-Python Ed25519 check (RFC 8032) for signed
checkpoints. It covers everything the spec says a verifier checks: lines (value space, canonical form, schema, seq,
chain, torn tail), the Merkle root, checkpoints (syntax, bytes signed, extension lines, origin, several keys),
`--since` (ledger or checkpoint base, torn base) and referenced files (which digests are files, where they are,
`.kvg` by zstd payload) and the score settings no kvgraft wrote (downgrades). Score recomputation needs kvgraft's
own scorer and is left to `kvgraft verify` (the spec says so); its findings are left out of the comparison.

Everything below the second ruler builds ledgers, checkpoints and files (with kvgraft's writers, as a user would),
tampers with them, and checks that both verifiers give the same verdict, the same bad lines, the same root, the same
checkpoint signers and the same status for every referenced file, and that every tampering is detected by both.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import stat
import struct
from pathlib import Path

import pytest
import zstandard
from conftest import REPO, run_cli

from kvgraft_cli.artifacts import container
from kvgraft_cli.artifacts.identity import payload_identity as kvg_identity
from kvgraft_cli.audit import hashcache
from kvgraft_cli.audit.verify import verify_ledger
from kvgraft_cli.errors import InputError
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.ledger.checkpoint import Checkpoint, generate_key, sign


# ==== the independent verifier: only this block is written from docs/LEDGER.md =====================================
class Unusable(Exception):
    """Unusable input: `kvgraft verify` exits 2."""


EMPTY_ROOT = hashlib.sha256(b"").digest()
HEX64 = re.compile(r"[0-9a-f]{64}")
KIND = re.compile(r"[a-z][a-z0-9-]*")
TIME = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[Tt]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?"
    r"([Zz]|[+-]([01]\d|2[0-3]):?[0-5]\d)",
    re.ASCII,
)
SIZE = re.compile(r"0|[1-9][0-9]*", re.ASCII)
SIG_PREFIX = "\u2014 "


def _in_value_space(v) -> bool:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return True
    if isinstance(v, int):
        return abs(v) <= 2**53 - 1
    if isinstance(v, list):
        return all(_in_value_space(x) for x in v)
    if isinstance(v, dict):
        return all(all(0x20 <= ord(c) <= 0x7E for c in k) and _in_value_space(x) for k, x in v.items())
    return False  # floats


def _time_ok(t) -> bool:
    m = isinstance(t, str) and TIME.fullmatch(t)
    if not m:
        return False
    y, mo, d = int(m[1]), int(m[2]), int(m[3])
    leap = y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)
    days = [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return 1 <= mo <= 12 and 1 <= d <= days[mo - 1]


def _hex64(v) -> bool:
    return isinstance(v, str) and HEX64.fullmatch(v) is not None


def _digest_ok(d) -> bool:
    return (
        isinstance(d, dict)
        and _hex64(d.get("sha256"))
        and ("path" not in d or (isinstance(d["path"], str) and d["path"] != ""))
    )


def _schema_ok(e: dict) -> bool:
    """The per-kind rules of the spec's "Per-kind rules (the entry schema)"."""
    if not all(k in e for k in ("seq", "prev", "kind", "time")):
        return False
    if type(e["seq"]) is not int or e["seq"] < 0:
        return False
    if not (e["prev"] is None or _hex64(e["prev"])):
        return False
    if not (isinstance(e["kind"], str) and KIND.fullmatch(e["kind"])) or not _time_ok(e["time"]):
        return False
    if "manifest" in e:
        m = e["manifest"]
        if not (
            isinstance(m, dict)
            and _hex64(m.get("sha256"))
            and _hex64(m.get("compute_sha256"))
            and isinstance(m.get("source"), str)
            and isinstance(m.get("path", ""), str)
        ):
            return False
    if "model" in e and not _digest_ok(e["model"]):
        return False
    if "environment" in e and not isinstance(e["environment"], dict):
        return False
    if "drift" in e and not (
        isinstance(e["drift"], list)
        and all(isinstance(x, dict) and all(k in x for k in ("field", "pinned", "effective")) for x in e["drift"])
    ):
        return False
    for sec in ("inputs", "outputs"):
        if sec in e:
            if not isinstance(e[sec], dict):
                return False
            if any(isinstance(d, dict) and "sha256" in d and not _digest_ok(d) for d in e[sec].values()):
                return False
    need = {
        "deposit": (["problems_file", "record", "token_ids"], ["artifact", "logits"]),
        "graft": (["artifact"], []),
        "graft-check": (["artifact"], []),
        "serve": (
            ["request", "prompt_ids", "library", "prompt_cache", "settings"],
            ["generated_ids", "output", "finish_reason", "costs"],
        ),
    }.get(e["kind"])
    if need:
        if not all(k in e for k in ("manifest", "model", "environment", "inputs", "outputs")):
            return False
        if not all(k in e["inputs"] for k in need[0]) or not all(k in e["outputs"] for k in need[1]):
            return False
        if e["kind"] == "serve" and e["outputs"]["finish_reason"] not in ("stop", "length", "cancelled"):
            return False
    return True


def _mth(leaves: list[bytes]) -> bytes:
    """RFC 6962 Merkle Tree Hash, straight from the definition."""
    if not leaves:
        return EMPTY_ROOT
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return hashlib.sha256(b"\x01" + _mth(leaves[:k]) + _mth(leaves[k:])).digest()


def _root(lines: list[bytes]) -> bytes:
    return _mth([hashlib.sha256(b"\x00" + raw).digest() for raw in lines])


def _verify_inclusion(index: int, size: int, leaf: bytes, proof: list[bytes], root: bytes) -> bool:
    """RFC 9162 §2.1.3.2."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = hashlib.sha256(b"\x01" + p + r).digest()
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = hashlib.sha256(b"\x01" + r + p).digest()
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


# -- Ed25519 verification, RFC 8032 §5.1.7 (and its §6 reference code) --
_P = 2**255 - 19
_L = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _recover_x(y: int, sign: int) -> int | None:
    if y >= _P:
        return None
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P) % _P
    if x2 == 0:
        return None if sign else 0
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * _SQRT_M1 % _P
    if (x * x - x2) % _P:
        return None
    return _P - x if (x & 1) != sign else x


def _point(s: bytes):
    y = int.from_bytes(s, "little")
    x = _recover_x(y & ((1 << 255) - 1), y >> 255)
    return None if x is None else (x, y & ((1 << 255) - 1), 1, x * (y & ((1 << 255) - 1)) % _P)


def _add(p, q):
    a, b = (p[1] - p[0]) * (q[1] - q[0]) % _P, (p[1] + p[0]) * (q[1] + q[0]) % _P
    c, d = 2 * p[3] * q[3] * _D % _P, 2 * p[2] * q[2] % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


def _mul(s: int, p):
    q = (0, 1, 1, 0)
    while s:
        if s & 1:
            q = _add(q, p)
        p, s = _add(p, p), s >> 1
    return q


_BY = 4 * pow(5, _P - 2, _P) % _P
_B = (_recover_x(_BY, 0), _BY, 1, _recover_x(_BY, 0) * _BY % _P)


def ed25519_verify(public: bytes, message: bytes, signature: bytes) -> bool:
    if len(public) != 32 or len(signature) != 64:
        return False
    a, r = _point(public), _point(signature[:32])
    s = int.from_bytes(signature[32:], "little")
    if a is None or r is None or s >= _L:
        return False
    k = int.from_bytes(hashlib.sha512(signature[:32] + public + message).digest(), "little") % _L
    lhs, rhs = _mul(s, _B), _add(r, _mul(k, a))
    return (lhs[0] * rhs[2] - rhs[0] * lhs[2]) % _P == 0 and (lhs[1] * rhs[2] - rhs[1] * lhs[2]) % _P == 0


# -- checkpoints --
def _b64(text: str) -> bytes:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except Exception:
        raise Unusable("base64") from None
    if base64.b64encode(raw).decode("ascii") != text:
        raise Unusable("non-canonical base64")
    return raw


def _key_name_ok(name: str) -> bool:
    return bool(name) and "+" not in name and not any(c.isspace() for c in name)


def parse_note(text: str) -> tuple[str, int, bytes, list[tuple[str, bytes, bytes]]]:
    """(signed text, size, root, [(key name, key hash, signature)]) of a checkpoint, signed or not."""
    if any(c < " " and c != "\n" for c in text):
        raise Unusable("control character")
    k = text.rfind("\n\n")
    sigs = []
    if k >= 0 and text.startswith(SIG_PREFIX, k + 2):
        text, block = text[: k + 1], text[k + 2 :]
        if not block.endswith("\n") or block.count("\n") > 100:
            raise Unusable("signature block")
        for line in block[:-1].split("\n"):
            if not line.startswith(SIG_PREFIX):
                raise Unusable("not a signature line")
            name, _, payload = line[len(SIG_PREFIX) :].partition(" ")
            raw = _b64(payload)
            if not _key_name_ok(name) or len(raw) <= 4:
                raise Unusable("signature line")
            sigs.append((name, raw[:4], raw[4:]))
    if not text.endswith("\n"):
        raise Unusable("no final newline")
    lines = text[:-1].split("\n")
    if len(lines) < 3 or "" in lines or any(x.startswith(SIG_PREFIX) for x in lines[3:]):
        raise Unusable("checkpoint lines")
    if not SIZE.fullmatch(lines[1]) or int(lines[1]) > 2**64 - 1:
        raise Unusable("size")
    root = _b64(lines[2])
    if len(root) != 32:
        raise Unusable("root")
    return text, int(lines[1]), root, sigs


def parse_key(key: str) -> tuple[str, bytes, bytes]:
    if os.path.isfile(key):
        key = Path(key).read_text(encoding="utf-8")
    key = key.strip()
    parts = key.split("+", 2)
    if key.startswith("PRIVATE+KEY+") or len(parts) != 3 or not _key_name_ok(parts[0]):
        raise Unusable("key")
    name, khash, data = parts[0], parts[1], _b64(parts[2])
    if not re.fullmatch(r"[0-9a-fA-F]{8}", khash) or len(data) != 33 or data[0] != 1:
        raise Unusable("key")
    if bytes.fromhex(khash) != hashlib.sha256(name.encode() + b"\n" + data).digest()[:4]:
        raise Unusable("key hash")
    return name, bytes.fromhex(khash), data[1:]


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        raise Unusable(str(path)) from None


# -- scores: settings no kvgraft wrote (the rest of a score needs kvgraft's scorer) --
RULES_EXTRACTORS = {"1": ("1", "2"), "2": ("3",)}
RULES_2_SETTINGS = ("extractor_version", "answered_only", "grader", "grader_version")
RULES_2_RESULT = ("rules", "answered", "unanswered", "no_reference", "answered_only", "grader", "grader_libs")


def _ver(v) -> tuple | None:
    parts = v.split(".") if isinstance(v, str) else [""]
    return tuple(int(p) for p in parts) if all(re.fullmatch(r"[0-9]+", p) for p in parts) else None


def score_settings_ok(e: dict, rules_before: bool) -> bool:
    """Spec, "Scores": whether some kvgraft could have written this score's settings (``rules_before``: an earlier
    score line of the ledger records settings.rules)."""
    ins, outs = e.get("inputs"), e.get("outputs")
    if not isinstance(ins, dict) or not isinstance(outs, dict) or not isinstance(outs.get("result"), dict):
        return True  # a finding of the scorer's part, not this one
    s = ins["settings"] if isinstance(ins.get("settings"), dict) else {}
    r = outs["result"]
    if "rules" not in s:
        return (
            not any(k in s for k in RULES_2_SETTINGS)
            and not any(k in r for k in RULES_2_RESULT)
            and str(r.get("extractor_version", "2")) in RULES_EXTRACTORS["1"]
            and not (isinstance(e.get("time"), str) and e["time"][:10] > "2026-12-01")
            and not rules_before
        )
    rules, ext = s["rules"], s.get("extractor_version")
    if _ver(rules) is None or ("extractor_version" in r and r["extractor_version"] != ext):
        return False
    if rules not in RULES_EXTRACTORS:
        return _ver(rules) > (2,)  # a later kvgraft's rules: not recomputable, not refused
    if _ver(ext) is None or _ver(ext) < _ver(RULES_EXTRACTORS[rules][0]):
        return False
    if rules == "1":
        return (
            ext in RULES_EXTRACTORS["1"]
            and not any(k in s for k in RULES_2_SETTINGS[1:])
            and not any(k in r for k in RULES_2_RESULT)
        )
    grader, pin = s.get("grader", "exact"), s.get("grader_version")
    if grader == "exact":
        return "grader_version" not in s
    if grader == "math-verify":
        libs = r.get("grader_libs")
        return (
            _ver(pin) is not None
            and _ver(pin) >= (0, 9, 0)
            and (libs is None or (isinstance(libs, dict) and libs.get("math-verify") == pin))
        )
    return True


# -- files --
def max_payload() -> int:
    """KVGRAFT_MAX_PAYLOAD: bytes, or with a K/M/G/T suffix (binary); default 32 GiB."""
    raw = os.environ.get("KVGRAFT_MAX_PAYLOAD", "").strip()
    m = re.fullmatch(r"([0-9]+)([KMGTkmgt]?)", raw)
    return int(m[1]) << (10 * " KMGT".index(m[2].upper() or " ")) if m else 32 << 30


def file_digest(path: Path) -> str | None:
    """SHA-256 of the bytes, or of the payload for a .kvg: a raw v2 container's payload, else the zstd frame's
    (None: not a valid .kvg file)."""
    data = path.read_bytes()
    if path.suffix != ".kvg":
        return hashlib.sha256(data).hexdigest()
    if data[:8] == b"\x89KVG\r\n\x1a\n":
        (h,) = struct.unpack("<I", data[8:12])
        try:
            c = json.loads(data[12 : 12 + h])
        except ValueError:
            return None
        if c.get("version") != 2:
            return None
        if isinstance(c.get("payload_bytes"), int) and c["payload_bytes"] > max_payload():
            raise Unusable("payload over KVGRAFT_MAX_PAYLOAD")  # bad input, not a mismatch
        if c.get("codec") == "shuffle-zstd":
            return shuffled_digest(data, c)
        if c.get("codec") != "raw" or len(data) != c["payload_offset"] + c["payload_bytes"]:
            return None
        return identity(data[c["payload_offset"] :])
    try:
        size = zstandard.get_frame_parameters(data).content_size
        if not 0 < size < 2**64 - 1:
            return None
        if size > max_payload():
            raise Unusable("payload over KVGRAFT_MAX_PAYLOAD")  # bad input, not a mismatch
        payload = zstandard.ZstdDecompressor().decompress(data, allow_extra_data=False)
    except zstandard.ZstdError:
        return None
    return identity(payload) if len(payload) == size else None


def shuffled_digest(data: bytes, c: dict) -> str | None:
    """A shuffle-zstd container's payload identity: each frame checked against its listed SHA-256, decompressed to
    exactly its chunk's length, its byte planes put back (None: a rule broken)."""
    pos, size, e, payload = c["payload_offset"], c["chunk_bytes"], c["element_bytes"], bytearray()
    if len(c["chunks"]) != -(-c["payload_bytes"] // size):
        return None
    for k, (stored, sha) in enumerate(c["chunks"]):
        frame = data[pos : pos + stored]
        pos += stored
        want = min(size, c["payload_bytes"] - k * size)
        if hashlib.sha256(frame).hexdigest() != sha:
            return None
        try:
            planes = zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False)
        except zstandard.ZstdError:
            return None
        if len(planes) != want:
            return None
        m, chunk = want // e, bytearray(planes)
        for j in range(e):
            chunk[j : m * e : e] = planes[j * m : (j + 1) * m]
        payload += chunk
    if pos != len(data) or len(payload) != c["payload_bytes"]:
        return None
    return identity(bytes(payload))


def identity(payload: bytes) -> str | None:
    """A payload's identity: SHA-256, or the sha256-tree its safetensors header names (None: another name)."""
    scheme = "sha256"
    n = int.from_bytes(payload[:8], "little") if len(payload) >= 8 else 0
    if 2 <= n <= 8 << 20 and len(payload) >= 8 + n:
        try:
            meta = json.loads(payload[8 : 8 + n]).get("__metadata__")
            scheme = meta.get("identity", "sha256") if isinstance(meta, dict) else "sha256"
        except (ValueError, AttributeError):
            pass
    if scheme == "sha256":
        return hashlib.sha256(payload).hexdigest()
    if scheme != "sha256-tree":
        return None
    leaves = b"".join(hashlib.sha256(payload[i : i + (1 << 20)]).digest() for i in range(0, len(payload), 1 << 20))
    return hashlib.sha256(b"kvgraft/sha256-tree/v1\n" + len(payload).to_bytes(8, "little") + leaves).hexdigest()


def referenced_files(entry: dict) -> list[tuple[str, dict]]:
    def is_file(d):
        return isinstance(d, dict) and isinstance(d.get("path"), str) and isinstance(d.get("sha256"), str)

    out = [("manifest", entry["manifest"])] if is_file(entry.get("manifest")) else []
    for sec in ("inputs", "outputs"):
        if isinstance(entry.get(sec), dict):
            out += [(f"{sec}.{name}", d) for name, d in entry[sec].items() if is_file(d)]
    return out


def spec_verify(
    path: Path,
    *,
    checkpoint: Path | None = None,
    keys: tuple[str, ...] = (),
    since: Path | None = None,
    files: bool = True,
) -> dict:
    """The verdict of docs/LEDGER.md: status pass | fail | input, the 1-based bad lines, the ledger-wide findings,
    the Merkle root, the checkpoint's signers and every referenced file's status."""
    try:
        return _spec_verify(Path(path), checkpoint, keys, since, files)
    except Unusable:
        return {"status": "input"}


def _spec_verify(path, checkpoint, keys, since, files) -> dict:
    if not path.is_file():
        raise Unusable("no ledger")
    if keys and checkpoint is None:
        raise Unusable("--key needs --checkpoint")
    *lines, tail = path.read_bytes().split(b"\n")
    bad: set[int] = set()
    whole: set[str] = set()
    entries = []
    prev = None
    for i, raw in enumerate(lines):
        try:
            e = json.loads(raw)
        except ValueError:
            e = None
        ok = isinstance(e, dict) and _in_value_space(e)
        if ok:
            try:
                ok = json.dumps(e, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode() == raw
            except UnicodeEncodeError:  # a lone surrogate
                ok = False
        if isinstance(e, dict):
            ok = (
                ok
                and _schema_ok(e)
                and e.get("seq") == i
                and e.get("prev") == (hashlib.sha256(prev).hexdigest() if prev is not None else None)
            )
        if not ok:
            bad.add(i + 1)
        entries.append(e if isinstance(e, dict) else None)
        prev = raw
    if tail:
        bad.add(len(lines) + 1)
    result = {"root": _root(lines).hex(), "signed_by": [], "files": {}}

    if checkpoint is not None:
        text, size, root, sigs = parse_note(_read_text(Path(checkpoint)))
        if size > len(lines) or _root(lines[:size]) != root:
            whole.add("checkpoint")
        if keys:
            trusted = {}
            for k in keys:
                name, khash, public = parse_key(k)
                if trusted.setdefault((name, khash), public) != public:
                    raise Unusable("two keys, one name and hash")
            if not sigs:
                raise Unusable("--key with an unsigned checkpoint")
            signed, failed = [], False
            for name, khash, sig in sigs:
                if (name, khash) in trusted:
                    if ed25519_verify(trusted[(name, khash)], text.encode("utf-8"), sig):
                        signed += [name] if name not in signed else []
                    else:
                        failed = True
            if failed or not signed:
                whole.add("signature")
            else:
                result["signed_by"] = signed

    if since is not None:
        since = Path(since)
        try:
            base = since.read_bytes()
        except OSError:
            raise Unusable("no base") from None
        if base[:1] in (b"", b"{"):
            base_lines = base.split(b"\n")[:-1]  # the torn tail, if any, is ignored
            size, root = len(base_lines), _root(base_lines)
            diff = next((i + 1 for i, (a, b) in enumerate(zip(base_lines, lines)) if a != b), None)
            if diff:
                bad.add(diff)
        else:
            try:
                text = base.decode("utf-8")
            except UnicodeDecodeError:
                raise Unusable("base") from None
            _, size, root, _ = parse_note(text)
            diff = None
            if size == 0 and root != EMPTY_ROOT:
                whole.add("append-only")
        if size > len(lines):
            whole.add("append-only")
        elif size and _root(lines[:size]) != root and not diff:
            whole.add("append-only")

    if files:
        hashed: dict[Path, str | None] = {}
        for i, e in enumerate(entries):
            if e is None:
                continue
            for field, d in referenced_files(e):
                target = Path(d["path"]) if os.path.isabs(d["path"]) else path.parent / d["path"]
                try:
                    present = target.is_file()
                except (OSError, ValueError):
                    present = False
                if not present:
                    status = "missing"
                else:
                    if target not in hashed:
                        hashed[target] = file_digest(target)
                    status = "ok" if hashed[target] == d["sha256"] else "mismatch"
                result["files"][(i + 1, field, d["path"])] = status
        rules_before = False  # scores are checked with files, and skipped with them (--no-files)
        for i, e in enumerate(entries):
            if e is not None and e.get("kind") == "score":
                if not score_settings_ok(e, rules_before):
                    bad.add(i + 1)
                ins = e.get("inputs")
                rules_before |= (
                    isinstance(ins, dict) and isinstance(ins.get("settings"), dict) and "rules" in ins["settings"]
                )
    failed = bad or whole or "mismatch" in result["files"].values()
    return {**result, "status": "fail" if failed else "pass", "bad_lines": bad, "whole": whole}


# =====================================================================================================================


def kvgraft_verdict(path: Path, **kw) -> dict:
    """`kvgraft verify`'s report in the same shape (score findings, which need kvgraft's scorer, left out)."""
    try:
        r = verify_ledger(path, cache=False, **kw)
    except InputError:
        return {"status": "input"}
    found = [f for f in r.findings if f.check != "score"]
    return {
        "status": "fail" if found or r.mismatched else "pass",
        "root": r.root,
        "bad_lines": {f.line for f in found if f.line is not None},
        "whole": {f.check for f in found if f.line is None},
        "signed_by": (r.checkpoint or {}).get("signed_by", []),
        "files": {(f.line, f.field, f.path): f.status for f in r.files},
    }


def agree(path: Path, *, files: bool = True, **kw) -> dict:
    """Both verdicts, asserted equal; returns it."""
    mine = spec_verify(path, files=files, **kw)
    theirs = kvgraft_verdict(path, rehash=files, **kw)
    assert mine == theirs
    return mine


def _base(path, n=10):
    for i in range(n):
        ledger.append(path, "note" if i % 3 else "test", {"n": i, "note": 'ü\n\t"x"', "r": {"v": 0.25 * i}})
    return path.read_bytes().split(b"\n")[:-1]


def _write(path: Path, lines: list[bytes], tail: bytes = b"") -> bytes:
    data = b"".join(x + b"\n" for x in lines) + tail
    path.write_bytes(data)
    return data


def _rechain(entries: list[dict]) -> list[bytes]:
    """Canonical lines with seq and prev recomputed: a change to one entry then fails only that entry's checks."""
    out, prev = [], None
    for i, e in enumerate(entries):
        e = dict(e, seq=i, prev=hashlib.sha256(prev).hexdigest() if prev is not None else None)
        prev = json.dumps(e, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
        out.append(prev)
    return out


def _edit(lines: list[bytes], i: int, **changes) -> list[bytes]:
    entries = [json.loads(x) for x in lines]
    for k, v in changes.items():
        if v is ...:
            entries[i].pop(k, None)
        else:
            entries[i][k] = v
    return _rechain(entries)


H = "ab" * 32
MANIFEST = {"source": "builtin:default.yaml", "sha256": H, "compute_sha256": H}
DEPOSIT = {
    "manifest": MANIFEST,
    "model": {"sha256": H},
    "environment": {},
    "inputs": {"problems_file": {"sha256": H}, "record": {"sha256": H}, "token_ids": {"sha256": H}},
    "outputs": {"artifact": {"sha256": H}, "logits": {"sha256": H}},
}
SERVE_IN = {
    "request": {"sha256": H, "endpoint": "chat", "log": "l.requests.jsonl"},
    "prompt_ids": {"sha256": H, "count": 3},
    "library": {"hit": "none", "artifacts": [], "chain": []},
    "prompt_cache": {"chunk": 16, "chunks": [], "deposited": [], "refused": []},
    "settings": {"k": 0, "max_tokens": None, "stop": []},
}
SERVE_OUT = {
    "first_logits": {"sha256": H},
    "generated_ids": {"sha256": H, "count": 2},
    "output": {"sha256": H},
    "finish_reason": "stop",
    "costs": {"prompt_tokens": 3, "decode_tokens": 2},
}
SERVE = {**DEPOSIT, "inputs": SERVE_IN, "outputs": SERVE_OUT}

CASES = {
    # name: (lines -> lines, line-level problem expected)
    "good": lambda ls: ls,
    "edit": lambda ls: ls[:4] + [ls[4].replace(b'"n":4', b'"n":5')] + ls[5:],
    "spaces": lambda ls: ls[:4] + [ls[4].replace(b'"n":4', b'"n" :4')] + ls[5:],
    "escape": lambda ls: ls[:2] + [ls[2].replace(b"\\t", b"\\u0009")] + ls[3:],
    "delete": lambda ls: ls[:6] + ls[7:],
    "reorder": lambda ls: ls[:1] + [ls[2], ls[1]] + ls[3:],
    "float": lambda ls: ls[:8] + [ls[8].replace(b'"n":8', b'"n":8.0')] + ls[9:],
    "minus zero": lambda ls: ls[:8] + [ls[8].replace(b'"n":8', b'"n":-0')] + ls[9:],
    "big int": lambda ls: _edit(ls, 3, n=2**53),
    "surrogate": lambda ls: ls[:3] + [ls[3].replace(b'"n":3', b'"n":"\\ud800"')] + ls[4:],
    "duplicate key": lambda ls: ls[:3] + [ls[3].replace(b'"n":3', b'"n":3,"n":3')] + ls[4:],
    "drop first": lambda ls: ls[1:],
    "only newline": lambda ls: [b""],
    "empty": lambda ls: [],
    # the schema: per-kind rules and time
    "utc micro": lambda ls: _edit(ls, 2, time="2026-01-01T00:00:00.123456+00:00"),
    "offset, no fraction": lambda ls: _edit(ls, 2, time="2026-01-01T05:30:00+05:30"),
    "lowercase t z": lambda ls: _edit(ls, 2, time="2026-01-01t00:00:00z"),
    "offset without colon": lambda ls: _edit(ls, 2, time="2026-01-01T00:00:00+0530"),
    "leap second": lambda ls: _edit(ls, 2, time="2026-06-30T23:59:60Z"),
    "29 feb leap": lambda ls: _edit(ls, 2, time="2024-02-29T00:00:00Z"),
    "time goes back": lambda ls: _edit(ls, 5, time="1999-01-01T00:00:00Z"),
    "29 feb": lambda ls: _edit(ls, 2, time="2026-02-29T00:00:00Z"),
    "no offset": lambda ls: _edit(ls, 2, time="2026-01-01T00:00:00"),
    "space for T": lambda ls: _edit(ls, 2, time="2026-01-01 00:00:00Z"),
    "hour 24": lambda ls: _edit(ls, 2, time="2026-01-01T24:00:00Z"),
    "time number": lambda ls: _edit(ls, 2, time=5),
    # DIGIT is ASCII 0-9 (#24.1): Arabic-Indic and fullwidth digits are other Unicode decimal digits
    "arabic-indic digits": lambda ls: _edit(ls, 2, time="\u0662\u0660\u0662\u0666-12-02T00:00:00Z"),
    "fullwidth digits": lambda ls: _edit(ls, 2, time="2026-12-02T0\uff10:00:00Z"),
    "no time": lambda ls: _edit(ls, 2, time=...),
    "kind upper": lambda ls: _edit(ls, 2, kind="Note"),
    "kind newline": lambda ls: _edit(ls, 2, kind="note\n"),
    "seq bool": lambda ls: ls[:1] + [ls[1].replace(b'"seq":1', b'"seq":true')] + ls[2:],  # true == 1 in Python
    "prev upper": lambda ls: ls[:1] + [ls[1].replace(b'"prev":"', b'"prev":"' + b"A")] + ls[2:],
    "digest upper": lambda ls: _edit(ls, 2, inputs={"x": {"sha256": H.upper()}}),
    "digest empty path": lambda ls: _edit(ls, 2, inputs={"x": {"sha256": H, "path": ""}}),
    "digest nested bad": lambda ls: _edit(ls, 2, inputs={"x": {"y": {"sha256": "zz"}}, "z": [{"sha256": 1}]}),
    "inputs list": lambda ls: _edit(ls, 2, inputs=[1]),
    "manifest no pin": lambda ls: _edit(ls, 2, manifest={"source": "s", "sha256": H}),
    "manifest empty path": lambda ls: _edit(ls, 2, manifest={**MANIFEST, "path": ""}),
    "model no sha": lambda ls: _edit(ls, 2, model={"path": "m"}),
    "drift": lambda ls: _edit(ls, 2, drift=[{"field": "f", "pinned": 1, "effective": 2}]),
    "drift incomplete": lambda ls: _edit(ls, 2, drift=[{"field": "f", "pinned": 1}]),
    "deposit complete": lambda ls: _edit(ls, 2, kind="deposit", **DEPOSIT),
    "deposit no logits": lambda ls: _edit(ls, 2, kind="deposit", **{**DEPOSIT, "outputs": {"artifact": {"sha256": H}}}),
    "deposit no model": lambda ls: _edit(ls, 2, kind="deposit", **{**DEPOSIT, "model": ...}),
    "graft-check complete": lambda ls: _edit(
        ls, 2, kind="graft-check", **{**DEPOSIT, "inputs": {"artifact": {"sha256": H}}, "outputs": {}}
    ),
    "graft no artifact": lambda ls: _edit(ls, 2, kind="graft", **{**DEPOSIT, "inputs": {}}),
    "serve complete": lambda ls: _edit(ls, 2, kind="serve", **SERVE),
    "serve cancelled": lambda ls: _edit(
        ls, 2, kind="serve", **{**SERVE, "outputs": {**SERVE_OUT, "finish_reason": "cancelled"}}
    ),
    "serve other reason": lambda ls: _edit(
        ls, 2, kind="serve", **{**SERVE, "outputs": {**SERVE_OUT, "finish_reason": "eos"}}
    ),
    "serve no costs": lambda ls: _edit(
        ls, 2, kind="serve", **{**SERVE, "outputs": {k: v for k, v in SERVE_OUT.items() if k != "costs"}}
    ),
    "serve no prompt_cache": lambda ls: _edit(
        ls, 2, kind="serve", **{**SERVE, "inputs": {k: v for k, v in SERVE_IN.items() if k != "prompt_cache"}}
    ),
    "score anything": lambda ls: _edit(ls, 2, kind="score-ish", inputs={}),
}
PASSING = {
    "good",
    "empty",
    "utc micro",
    "offset, no fraction",
    "lowercase t z",
    "offset without colon",
    "leap second",
    "29 feb leap",
    "time goes back",
    "digest nested bad",
    "manifest empty path",
    "drift",
    "deposit complete",
    "graft-check complete",
    "serve complete",
    "serve cancelled",
    "score anything",
}


@pytest.mark.parametrize("name", sorted(CASES) + ["torn"])
def test_lines_and_schema_agree(tmp_path, name):
    p = tmp_path / "l.jsonl"
    lines = _base(p)
    if name == "torn":
        _write(p, lines, lines[0][:20])
    else:
        _write(p, CASES[name](lines))
    v = agree(p, files=False)
    assert (v["status"] == "pass") == (name in PASSING), v
    r = verify_ledger(p, rehash=False)
    assert r.passed == (v["status"] == "pass")  # the report's own verdict, not only its findings
    if name in ("good", "empty"):
        assert v["root"] == r.root
    if name == "empty":
        assert v["root"] == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_line_numbers_are_1_based_and_prove_takes_a_line(tmp_path):
    """seq is 0-based; messages, findings and `ledger prove LINE` are 1-based; prove's leafIdx is the seq."""
    p = tmp_path / "l.jsonl"
    lines = _base(p, 9)
    _write(p, lines[:3] + [lines[3].replace(b'"n":3', b'"n": 3')] + lines[4:])
    r = verify_ledger(p, rehash=False)
    assert r.first_problem().startswith("line 4:") and json.loads(lines[3])["seq"] == 3
    _write(p, lines)
    out = json.loads(
        run_cli("ledger", "prove", "4", "l.jsonl", "--size", "7", "--json", cwd=tmp_path, check_rc=0).stdout
    )
    b = base64.b64decode
    assert out["leafIdx"] == json.loads(lines[3])["seq"] == 3 and out["treeSize"] == 7
    assert b(out["leafHash"]) == hashlib.sha256(b"\x00" + lines[3]).digest()
    assert b(out["root"]) == _root(lines[:7])
    assert _verify_inclusion(out["leafIdx"], 7, b(out["leafHash"]), [b(h) for h in out["proof"]], b(out["root"]))
    assert not _verify_inclusion(4, 7, b(out["leafHash"]), [b(h) for h in out["proof"]], b(out["root"]))


# ---- checkpoints ------------------------------------------------------------------------------------------------
KEYS = {n: generate_key(n) for n in ("alice", "bob")}
KEYS["alice-other"] = generate_key("alice")  # same name, another key


def _signed(text: str, *names: str) -> str:
    for n in names:
        text = sign(text, KEYS[n][0])
    return text


def _corrupt_sig(text: str, name: str) -> str:
    """Flip one bit of NAME's signature (the line stays well-formed)."""
    out = []
    for line in text.split("\n"):
        if line.startswith(f"\u2014 {name} "):
            head, b64 = line.rsplit(" ", 1)
            raw = bytearray(base64.b64decode(b64))
            raw[10] ^= 1
            line = f"{head} {base64.b64encode(bytes(raw)).decode()}"
        out.append(line)
    return "\n".join(out)


def _short_sig(text: str, name: str) -> str:
    out = []
    for line in text.split("\n"):
        if line.startswith(f"\u2014 {name} "):
            head, b64 = line.rsplit(" ", 1)
            line = f"{head} {base64.b64encode(base64.b64decode(b64)[:-1]).decode()}"
        out.append(line)
    return "\n".join(out)


def _checkpoint_cases(lines: list[bytes]):
    def body(size=6, origin="kvgraft-ledger", ext=()):
        return Checkpoint(origin, size, _root(lines[:size]), tuple(ext)).body()

    b64root = base64.b64encode(_root(lines[:6])).decode()
    # name: (checkpoint text, verifier key names, expected status, expected signers)
    return {
        "plain": (body(), [], "pass", []),
        "older size": (body(3), [], "pass", []),
        "whole ledger": (body(len(lines)), [], "pass", []),
        "size 0": (body(0), [], "pass", []),
        "size 0 wrong root": ("kvgraft-ledger\n0\n" + b64root + "\n", [], "fail", []),
        "size too big": (body(len(lines)).replace(f"\n{len(lines)}\n", f"\n{len(lines) + 1}\n"), [], "fail", []),
        "size changed": (body().replace("\n6\n", "\n5\n"), [], "fail", []),
        "root byte": (
            body().replace(b64root, base64.b64encode(bytes([_root(lines[:6])[0] ^ 1]) + _root(lines[:6])[1:]).decode()),
            [],
            "fail",
            [],
        ),
        "other origin": (body(origin="example.com/another-log"), [], "pass", []),
        "signed": (_signed(body(), "alice"), ["alice"], "pass", ["alice"]),
        "signed, no key given": (_signed(body(), "alice"), [], "pass", []),
        "cosigned, both keys": (_signed(body(), "alice", "bob"), ["alice", "bob"], "pass", ["alice", "bob"]),
        "cosigned, one key": (_signed(body(), "alice", "bob"), ["bob"], "pass", ["bob"]),
        "one bad of two trusted": (_corrupt_sig(_signed(body(), "alice", "bob"), "bob"), ["alice", "bob"], "fail", []),
        "bad one untrusted": (_corrupt_sig(_signed(body(), "alice", "bob"), "bob"), ["alice"], "pass", ["alice"]),
        "bad one, no key given": (_corrupt_sig(_signed(body(), "alice"), "alice"), [], "pass", []),
        "short signature": (_short_sig(_signed(body(), "alice"), "alice"), ["alice"], "fail", []),
        "same name other key": (_signed(body(), "alice"), ["alice-other"], "fail", []),
        "untrusted signer": (_signed(body(), "alice"), ["bob"], "fail", []),
        "extensions signed": (_signed(body(ext=["ext-1", "x y z"]), "alice"), ["alice"], "pass", ["alice"]),
        "extension edited": (_signed(body(ext=["ext-1"]), "alice").replace("ext-1", "ext-2"), ["alice"], "fail", []),
        "extension edited, no key": (_signed(body(ext=["ext-1"]), "alice").replace("ext-1", "ext-2"), [], "pass", []),
        "extension dropped": (_signed(body(ext=["ext-1"]), "alice").replace("ext-1\n", ""), ["alice"], "fail", []),
        "origin edited": (_signed(body(), "alice").replace("kvgraft-ledger", "kvgraft-ledgeR"), ["alice"], "fail", []),
        "origin edited, no key": (_signed(body(), "alice").replace("kvgraft-ledger", "kvgraft-ledgeR"), [], "pass", []),
        "size edited": (_signed(body(), "alice").replace("\n6\n", "\n5\n", 1), ["alice"], "fail", []),
        "root edited, resigned by no one": (
            _signed(body(3), "alice").replace(body(3).split("\n")[2], b64root),
            ["alice"],
            "fail",
            [],
        ),
        "key file": (_signed(body(), "alice"), ["@alice"], "pass", ["alice"]),
        # unusable input (exit 2)
        "unsigned with key": (body(), ["alice"], "input", []),
        "crlf": (body().replace("\n", "\r\n"), [], "input", []),
        "size leading zero": (body().replace("\n6\n", "\n06\n"), [], "input", []),
        "root not canonical": (body().replace(b64root, b64root.rstrip("=")), [], "input", []),
        "blank line, no signatures": (body() + "\n", [], "input", []),
        "no final newline": (body()[:-1], [], "input", []),
        "two lines": ("kvgraft-ledger\n6\n", [], "input", []),
        "garbage after signatures": (_signed(body(), "alice") + "not a signature\n", [], "input", []),
        "signature line with bad name": (
            _signed(body(), "alice").replace("\u2014 alice ", "\u2014 al+ice "),
            [],
            "input",
            [],
        ),
        "signature not base64": (_signed(body(), "alice")[:-3] + "!!\n", [], "input", []),
        "malformed key": (_signed(body(), "alice"), ["garbage"], "input", []),
        "private key given": (_signed(body(), "alice"), ["!alice"], "input", []),
        "not utf-8": (b"\xff\xfe", [], "input", []),
    }


def _key_args(names, tmp_path):
    out = []
    for n in names:
        if n.startswith("@"):  # a key file, as `ledger keygen` writes it
            (tmp_path / "alice.pub").write_text(KEYS[n[1:]][1] + "\n")
            out.append(str(tmp_path / "alice.pub"))
        elif n.startswith("!"):
            out.append(KEYS[n[1:]][0])
        else:
            out.append(KEYS[n][1] if n in KEYS else n)
    return tuple(out)


CHECKPOINT_CASES = list(_checkpoint_cases([b"x"] * 10))  # names only; the texts are built per test


@pytest.mark.parametrize("name", CHECKPOINT_CASES)
def test_checkpoints_agree(tmp_path, name):
    p = tmp_path / "l.jsonl"
    lines = _base(p, 8)
    text, keys, expected, signers = _checkpoint_cases(lines)[name]
    cp = tmp_path / "cp"
    cp.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    v = agree(p, checkpoint=cp, keys=_key_args(keys, tmp_path), files=False)
    assert v["status"] == expected, v
    if expected != "input":
        assert v["signed_by"] == signers and not v["bad_lines"]


def test_checkpoint_ignores_a_torn_tail_and_cli_exit_codes(tmp_path):
    p = tmp_path / "l.jsonl"
    lines = _base(p, 6)
    cp = tmp_path / "cp"
    cp.write_text(_signed(Checkpoint("o", 6, _root(lines)).body(), "alice"))
    _write(p, lines, b'{"torn')
    v = agree(p, checkpoint=cp, keys=(KEYS["alice"][1],), files=False)
    assert v["status"] == "fail" and v["bad_lines"] == {7} and not v["whole"] and v["signed_by"] == ["alice"]
    _write(p, lines)
    (tmp_path / "k.pub").write_text(KEYS["alice"][1] + "\n")
    run_cli("verify", "l.jsonl", "--checkpoint", "cp", "--key", "k.pub", "--no-cache", cwd=tmp_path, check_rc=0)
    run_cli("verify", "l.jsonl", "--key", "k.pub", "--no-cache", cwd=tmp_path, check_rc=2)
    cp.write_text(Checkpoint("o", 6, _root(lines)).body())
    run_cli("verify", "l.jsonl", "--checkpoint", "cp", "--key", "k.pub", "--no-cache", cwd=tmp_path, check_rc=2)
    cp.write_text(_corrupt_sig(_signed(Checkpoint("o", 6, _root(lines)).body(), "alice"), "alice"))
    run_cli("verify", "l.jsonl", "--checkpoint", "cp", "--key", "k.pub", "--no-cache", cwd=tmp_path, check_rc=1)


# ---- --since ----------------------------------------------------------------------------------------------------
def _since_cases(lines: list[bytes]):
    def cp(size, root=None, signed=False):
        text = Checkpoint("kvgraft-ledger", size, root or _root(lines[:size])).body()
        return (_signed(text, "alice") if signed else text).encode()

    edited = lines[:1] + [lines[1].replace(b'"n":1', b'"n":9')] + lines[2:4]
    # name: (BASE bytes or None for a missing file, expected status, expected bad lines)
    return {
        "empty file": (b"", "pass", set()),
        "older ledger": (b"".join(x + b"\n" for x in lines[:4]), "pass", set()),
        "same ledger": (b"".join(x + b"\n" for x in lines), "pass", set()),
        "older, torn tail": (b"".join(x + b"\n" for x in lines[:4]) + lines[4][:25], "pass", set()),
        "older, torn garbage": (b"".join(x + b"\n" for x in lines[:4]) + b"garbage", "pass", set()),
        "rewritten line 2": (b"".join(x + b"\n" for x in edited), "fail", {2}),
        "base longer": (b"".join(x + b"\n" for x in lines + lines[:2]), "fail", set()),
        "base longer and rewritten": (b"".join(x + b"\n" for x in edited + lines[4:] + lines[:3]), "fail", {2}),
        "base not canonical": (b"".join(x + b"\n" for x in [lines[0].replace(b":", b": ")] + lines[1:4]), "fail", {1}),
        "checkpoint older": (cp(4), "pass", set()),
        "checkpoint whole": (cp(len(lines)), "pass", set()),
        "checkpoint signed": (cp(4, signed=True), "pass", set()),
        "checkpoint badly signed": (_corrupt_sig(cp(4, signed=True).decode(), "alice").encode(), "pass", set()),
        "checkpoint size 0": (cp(0), "pass", set()),
        "checkpoint size 0 wrong root": (cp(0, root=b"\x11" * 32), "fail", set()),
        "checkpoint wrong root": (cp(4, root=_root(lines[:3])), "fail", set()),
        "checkpoint too big": (cp(len(lines) + 1, root=_root(lines)), "fail", set()),
        "checkpoint malformed": (cp(4).replace(b"\n4\n", b"\n+4\n"), "input", set()),
        "ledger with a BOM": (b"\xef\xbb\xbf" + b"".join(x + b"\n" for x in lines[:4]), "input", set()),
        "ledger with a space": (b" " + b"".join(x + b"\n" for x in lines[:4]), "input", set()),
        "not utf-8": (b"\xff\xfe\n", "input", set()),
        "missing": (None, "input", set()),
    }


@pytest.mark.parametrize("name", list(_since_cases([b"x"] * 8)))
def test_since_agrees(tmp_path, name):
    p = tmp_path / "l.jsonl"
    lines = _base(p, 8)
    data, expected, bad = _since_cases(lines)[name]
    base = tmp_path / "base"
    if data is not None:
        base.write_bytes(data)
    v = agree(p, since=base, files=False)
    assert v["status"] == expected, v
    if expected != "input":
        assert v["bad_lines"] == bad


# ---- referenced files -------------------------------------------------------------------------------------------
def _zstd(payload: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(**{"write_content_size": True, "write_checksum": True, **kw}).compress(payload)


def _flip_frame(data: bytes) -> bytes:
    """A shuffle-zstd file with one byte of its last frame changed (its listed SHA-256 no longer holds)."""
    b = bytearray(data)
    b[-3] ^= 1
    return bytes(b)


def _files_ledger(tmp_path: Path) -> tuple[Path, dict]:
    """A ledger naming files of every sort; returns it and the expected status of each (line, field, path)."""
    d = tmp_path / "run"
    (d / "sub").mkdir(parents=True)
    (tmp_path / "outside.txt").write_bytes(b"outside")
    payload = os.urandom(4096)
    other = b"\x00" * 4096
    body = os.urandom(3 << 20)  # a payload whose header names the tree: 4 leaves, the last one short
    head = json.dumps(
        {
            "__metadata__": {"identity": "sha256-tree"},
            "t": {"dtype": "U8", "shape": [len(body)], "data_offsets": [0, len(body)]},
        }
    ).encode()
    head += b" " * (-len(head) % 8)
    tree = len(head).to_bytes(8, "little") + head + body
    files = {
        "plain.txt": b"hello\n",
        "changed.txt": b"hello\n",
        "sub/m.yaml": b"model: x\n",
        "a.kvg": _zstd(payload),
        "b.kvg": _zstd(payload, level=19, write_checksum=False),
        "swapped.kvg": _zstd(other),
        "trailing.kvg": _zstd(payload) + _zstd(b"more"),
        "truncated.kvg": _zstd(payload)[:-6],
        "nosize.kvg": _zstd(payload, write_content_size=False),
        "empty.kvg": _zstd(b""),
        "zero.kvg": b"",
        "upper.KVG": _zstd(payload),
        "dir.kvg/x": b"",
        "tree.kvg": _zstd(tree),
        "unknown.kvg": _zstd(tree.replace(b'"sha256-tree"', b'"sha256-trie"')),
        "shuffled.kvg": container.shuffle_zstd_file(tree, 4, chunk_bytes=1 << 20),
        "shuffled-bad.kvg": _flip_frame(container.shuffle_zstd_file(tree, 4, chunk_bytes=1 << 20)),
    }
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    (d / "changed.txt").write_bytes(b"hellO\n")
    os.symlink(d / "plain.txt", d / "link.txt")
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    pay = sha(payload)
    lp = d / "ledger.jsonl"
    bodies = [
        (
            {
                "manifest": {**MANIFEST, "sha256": sha(b"model: x\n"), "path": "sub/m.yaml"},
                "inputs": {
                    "problems": {"path": "plain.txt", "sha256": sha(b"hello\n")},
                    "changed": {"path": "changed.txt", "sha256": sha(b"hello\n")},
                    "gone": {"path": "gone.txt", "sha256": H},
                    "n": 3,
                    "record": {"sha256": H},
                },
                "outputs": {
                    "artifact": {"path": "a.kvg", "sha256": pay},
                    "raw_sha": {"path": "a.kvg", "sha256": sha(files["a.kvg"])},
                },
            },
            {
                (1, "manifest", "sub/m.yaml"): "ok",
                (1, "inputs.problems", "plain.txt"): "ok",
                (1, "inputs.changed", "changed.txt"): "mismatch",
                (1, "inputs.gone", "gone.txt"): "missing",
                (1, "outputs.artifact", "a.kvg"): "ok",
                (1, "outputs.raw_sha", "a.kvg"): "mismatch",
            },
        ),
        (
            {
                "inputs": {
                    "level19": {"path": "b.kvg", "sha256": pay},
                    "swapped": {"path": "swapped.kvg", "sha256": pay},
                    "trailing": {"path": "trailing.kvg", "sha256": pay},
                    "truncated": {"path": "truncated.kvg", "sha256": pay},
                    "nosize": {"path": "nosize.kvg", "sha256": pay},
                    "empty": {"path": "empty.kvg", "sha256": sha(b"")},
                    "zero": {"path": "zero.kvg", "sha256": sha(b"")},
                    "upper": {"path": "upper.KVG", "sha256": sha(files["upper.KVG"])},
                    "dir": {"path": "dir.kvg", "sha256": H},
                    "tree": {"path": "tree.kvg", "sha256": kvg_identity(tree)},
                    "tree_as_sha256": {"path": "tree.kvg", "sha256": sha(tree)},
                    "unknown": {"path": "unknown.kvg", "sha256": sha(tree.replace(b'"sha256-tree"', b'"sha256-trie"'))},
                    "shuffled": {"path": "shuffled.kvg", "sha256": kvg_identity(tree)},
                    "shuffled_bad": {"path": "shuffled-bad.kvg", "sha256": kvg_identity(tree)},
                }
            },
            {
                (2, "inputs.level19", "b.kvg"): "ok",
                (2, "inputs.swapped", "swapped.kvg"): "mismatch",
                (2, "inputs.trailing", "trailing.kvg"): "mismatch",
                (2, "inputs.truncated", "truncated.kvg"): "mismatch",
                (2, "inputs.nosize", "nosize.kvg"): "mismatch",
                (2, "inputs.empty", "empty.kvg"): "mismatch",
                (2, "inputs.zero", "zero.kvg"): "mismatch",
                (2, "inputs.upper", "upper.KVG"): "ok",
                (2, "inputs.dir", "dir.kvg"): "missing",
                (2, "inputs.tree", "tree.kvg"): "ok",
                (2, "inputs.tree_as_sha256", "tree.kvg"): "mismatch",
                (2, "inputs.unknown", "unknown.kvg"): "mismatch",
                (2, "inputs.shuffled", "shuffled.kvg"): "ok",
                (2, "inputs.shuffled_bad", "shuffled-bad.kvg"): "mismatch",
            },
        ),
        (
            {
                "inputs": {
                    "abs": {"path": str(tmp_path / "outside.txt"), "sha256": sha(b"outside")},
                    "up": {"path": "../outside.txt", "sha256": sha(b"outside")},
                    "link": {"path": "link.txt", "sha256": sha(b"hello\n")},
                    "long": {"path": "x" * 5000, "sha256": H},
                    "nested": {"deeper": {"path": "gone.txt", "sha256": H}},
                    "list": [{"path": "gone.txt", "sha256": H}],
                },
                "model": {"path": "gone.txt", "sha256": H},
                "other": {"path": "gone.txt", "sha256": H},
                "outputs": {"no_sha": {"path": "gone.txt"}, "n": {"path": "gone.txt", "sha256": 5}},
            },
            {
                (3, "inputs.abs", str(tmp_path / "outside.txt")): "ok",
                (3, "inputs.up", "../outside.txt"): "ok",
                (3, "inputs.link", "link.txt"): "ok",
                (3, "inputs.long", "x" * 5000): "missing",
            },
        ),
        ({"inputs": [{"path": "gone.txt", "sha256": H}], "outputs": "gone.txt"}, {}),  # schema findings, no files
    ]
    expected = {}
    for body, exp in bodies:
        ledger.append(lp, "test", body)
        expected.update(exp)
    return lp, expected


def test_referenced_files_agree(tmp_path):
    lp, expected = _files_ledger(tmp_path)
    v = agree(lp)
    assert v["files"] == expected
    assert v["status"] == "fail" and v["bad_lines"] == {3, 4}  # outputs.n is no digest (sha256: 5); line 4's shape
    assert verify_ledger(lp, cache=False, require_files=True).passed is False


@pytest.mark.parametrize("form", ["zstd", "raw container", "shuffle-zstd container"])
def test_a_payload_over_the_limit_is_unusable_input_for_both(tmp_path, monkeypatch, form):
    """#24.4: a declared payload over KVGRAFT_MAX_PAYLOAD is bad input (exit 2), not a mismatch, for every file form;
    at the limit exactly it is read."""
    payload = os.urandom(4096)
    data = {
        "zstd": _zstd(payload),
        "raw container": container.raw_file(payload),
        "shuffle-zstd container": container.shuffle_zstd_file(payload, 4),
    }[form]
    (tmp_path / "a.kvg").write_bytes(data)
    lp = tmp_path / "ledger.jsonl"
    ledger.append(
        lp, "test", {"outputs": {"artifact": {"path": "a.kvg", "sha256": hashlib.sha256(payload).hexdigest()}}}
    )
    monkeypatch.setenv("KVGRAFT_MAX_PAYLOAD", "4K")
    assert agree(lp)["status"] == "pass"
    monkeypatch.setenv("KVGRAFT_MAX_PAYLOAD", "4095")
    assert agree(lp)["status"] == "input"
    assert (
        run_cli("verify", "ledger.jsonl", "--full", cwd=tmp_path, env={"KVGRAFT_MAX_PAYLOAD": "4095"}).returncode == 2
    )


R2 = {"rules": "2", "extractor_version": "3", "answered_only": False, "grader": "exact"}
MV = {**R2, "grader": "math-verify", "grader_version": "0.9.0"}
OLD = "2026-11-30T12:00:00.000000+00:00"
SCORE_CASES = {
    # name: ([(settings, result, time or None: now)], passes)
    "rules 2": ([(R2, {"rules": "2", "extractor_version": "3"}, None)], True),
    "rules 2, a later extractor": ([({**R2, "extractor_version": "4"}, {"extractor_version": "4"}, None)], True),
    "rules 2, extractor 1": ([({**R2, "extractor_version": "1"}, {"extractor_version": "1"}, None)], False),
    "rules 2, extractor 2": ([({**R2, "extractor_version": "2"}, {"extractor_version": "2"}, None)], False),
    "extractors differ": ([({**R2, "extractor_version": "9"}, {"extractor_version": "3"}, None)], False),
    "math-verify pin": ([(MV, {"extractor_version": "3", "grader_libs": {"math-verify": "0.9.0"}}, None)], True),
    "math-verify later": ([({**MV, "grader_version": "0.10.0"}, {"extractor_version": "3"}, None)], True),
    "math-verify 0.8.0": ([({**MV, "grader_version": "0.8.0"}, {"extractor_version": "3"}, None)], False),
    "math-verify no version": ([({**MV, "grader_version": ...}, {"extractor_version": "3"}, None)], False),
    "grader_libs other": ([(MV, {"extractor_version": "3", "grader_libs": {"math-verify": "0.8.0"}}, None)], False),
    "exact with a version": ([({**R2, "grader_version": "1"}, {"extractor_version": "3"}, None)], False),
    "rules 1, old": ([({}, {"extractor_version": "2", "unscored_problems": 1}, OLD)], True),
    "rules 1, extractor 1": ([({}, {"extractor_version": "1"}, OLD)], True),
    "rules 1, today": ([({}, {"extractor_version": "2"}, None)], False),
    "rules 1, extractor 3": ([({}, {"extractor_version": "3"}, OLD)], False),
    "rules 1, answered_only": ([({"answered_only": False}, {"extractor_version": "2"}, OLD)], False),
    "rules 1, result.answered": ([({}, {"extractor_version": "2", "answered": 3}, OLD)], False),
    "rules 1 after rules 2": ([(R2, {"extractor_version": "3"}, OLD), ({}, {"extractor_version": "2"}, OLD)], False),
    "rules 1 before rules 2": ([({}, {"extractor_version": "2"}, OLD), (R2, {"extractor_version": "3"}, None)], True),
    "rules 1, recorded": ([({"rules": "1", "extractor_version": "2"}, {"extractor_version": "2"}, None)], True),
    "rules 1, recorded, grader": (
        [({"rules": "1", "extractor_version": "2", "grader": "exact"}, {"extractor_version": "2"}, None)],
        False,
    ),
    "rules 0": ([({**R2, "rules": "0"}, {"extractor_version": "3"}, None)], False),
    "rules x": ([({**R2, "rules": "x"}, {"extractor_version": "3"}, None)], False),
    "rules 3 (later)": ([({**R2, "rules": "3"}, {"extractor_version": "3"}, None)], True),
    "rules 2, Arabic-Indic 3": (
        [({**R2, "extractor_version": "\u0663"}, {"extractor_version": "\u0663"}, None)],
        False,
    ),
}


@pytest.mark.parametrize("name", list(SCORE_CASES))
def test_score_settings_no_kvgraft_wrote_agree(tmp_path, name):
    """#24.2: the spec's rules for score settings no kvgraft wrote (older rules or versions, fields that came later,
    the ledger's order) need no scorer; both verifiers refuse the same lines. The files are absent, so nothing else
    about the score is checked (not recomputable)."""
    entries, passes = SCORE_CASES[name]
    p = tmp_path / "l.jsonl"
    for settings, result, _ in entries:
        settings = {k: v for k, v in settings.items() if v is not ...}
        ledger.append(p, "score", {"inputs": {"settings": {"mapping": {}, **settings}}, "outputs": {"result": result}})
    lines = p.read_bytes().split(b"\n")[:-1]
    for i, (_, _, time) in enumerate(entries):
        if time is not None:
            lines = _edit(lines, i, time=time)
    _write(p, lines)
    v = agree(p)
    assert (v["status"] == "pass") == passes, v
    r = verify_ledger(p, cache=False)
    assert [f.check for f in r.findings] == ([] if passes else ["score-settings"]), r.findings


def test_only_manifest_and_direct_members_are_files(tmp_path):
    """A passing ledger whose every file checks out, then each file changed in turn: both catch each change."""
    lp, expected = _files_ledger(tmp_path)
    lines = lp.read_bytes().split(b"\n")[:-1]
    entries = [json.loads(x) for x in lines]
    keep = {k for k, s in expected.items() if s == "ok"}
    for e in entries:
        for sec in ("inputs", "outputs"):
            if not isinstance(e.get(sec, {}), dict):
                del e[sec]
                continue
            e.get(sec, {}).pop("n", None)
            for name in list(e.get(sec, {})):
                d = e[sec][name]
                if (
                    isinstance(d, dict)
                    and isinstance(d.get("sha256"), str)
                    and isinstance(d.get("path"), str)
                    and (e["seq"] + 1, f"{sec}.{name}", d["path"]) not in keep
                ):
                    del e[sec][name]
    _write(lp, _rechain(entries))
    v = agree(lp)
    assert v["status"] == "pass" and set(v["files"]) == keep
    for line, field, path in sorted(keep, key=str):
        target = Path(path) if os.path.isabs(path) else lp.parent / path
        data = target.read_bytes()
        if target.suffix == ".kvg" and data[:8] == container.MAGIC:  # a valid shuffle-zstd file, one byte apart
            with open(target, "rb") as f:
                payload = bytearray(b"".join(container.iter_container(f, len(data), str(target), 1 << 40)))
            payload[-1] ^= 1
            target.write_bytes(container.shuffle_zstd_file(bytes(payload), 4, chunk_bytes=1 << 20))
        elif target.suffix == ".kvg":  # same payload size, one byte changed, recompressed: a valid frame
            payload = bytearray(zstandard.ZstdDecompressor().decompress(data))
            payload[7] ^= 1
            target.write_bytes(_zstd(bytes(payload)))
        else:
            target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        v = agree(lp)
        assert v["status"] == "fail" and v["files"][(line, field, path)] == "mismatch", (field, path)
        target.write_bytes(data)
    assert agree(lp)["status"] == "pass"


def test_real_ledger_agrees(deposited):
    ctx, _ = deposited
    v = agree(ctx.ledger)
    assert v["status"] == "pass"
    kvg = [k for k in v["files"] if k[2].endswith(".kvg")]
    assert kvg and all(v["files"][k] == "ok" for k in kvg)  # real artifacts, hashed by payload


# ---- this repository's reference ledger -------------------------------------------------------------------------
REFERENCE = REPO / "ledger" / "reference.jsonl"


def _reference_copy(tmp_path: Path) -> Path:
    """ledger/ and examples/ copied with their layout (the ledger names ../examples/...)."""
    shutil.copytree(REPO / "ledger", tmp_path / "ledger", ignore=shutil.ignore_patterns(".*", "*.lock"))
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    return tmp_path / "ledger" / "reference.jsonl"


def test_reference_ledger_agrees():
    v = agree(REFERENCE)
    lines = REFERENCE.read_bytes().split(b"\n")[:-1]
    assert v["status"] == "pass" and v["root"] == _root(lines).hex()
    assert {v["files"][k] for k in v["files"] if not k[2].startswith("../kvgraft-store/")} == {"ok"}
    assert any(k[1] == "inputs.prereg" for k in v["files"])
    # The repository's own signed checkpoint and key (docs/ci-ledger-gate.yml), by file, and as a --since base.
    cp, key = REFERENCE.parent / "checkpoint.txt", REFERENCE.parent / "kvgraft.pub"
    if cp.is_file() and key.is_file():
        v = agree(REFERENCE, checkpoint=cp, keys=(str(key),), since=cp, files=False)
        assert v["status"] == "pass" and v["signed_by"] == [key.read_text().split("+")[0]]


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


REFERENCE_TAMPERINGS = {
    # name: function(ledger path) -> kwargs for both verifiers
    "line byte": lambda p: _flip(p, 5000),
    "line deleted": lambda p: _write(p, p.read_bytes().split(b"\n")[:-1][:20] + p.read_bytes().split(b"\n")[:-1][21:]),
    "torn": lambda p: p.write_bytes(p.read_bytes()[:-40]),
    "outputs file": lambda p: _flip(p.parent.parent / "examples" / "outputs.jsonl", 10),
    "problems file": lambda p: _flip(p.parent.parent / "examples" / "problems.jsonl", 30),
    "prereg": lambda p: _flip(p.parent / "prereg-v2.yaml", 100),
    "checkpoint byte": lambda p: "checkpoint",
    "checkpoint signature": lambda p: "signature",
    "since rewritten": lambda p: "since",
}


@pytest.mark.parametrize("name", list(REFERENCE_TAMPERINGS))
def test_reference_ledger_tampering_is_detected_by_both(tmp_path, name):
    p = _reference_copy(tmp_path)
    lines = p.read_bytes().split(b"\n")[:-1]
    cp, base = tmp_path / "cp", tmp_path / "base.jsonl"
    cp.write_text(_signed(Checkpoint("github.com/kvgraft/reference", 24, _root(lines[:24])).body(), "alice", "bob"))
    keys = (KEYS["alice"][1], KEYS["bob"][1])
    base.write_bytes(b"".join(x + b"\n" for x in lines[:24]))
    assert agree(p, checkpoint=cp, keys=keys, since=base)["status"] == "pass"  # before
    what = REFERENCE_TAMPERINGS[name](p)
    kw = {"checkpoint": cp, "keys": keys, "since": base}
    if what == "checkpoint":
        text = cp.read_text()
        cp.write_text(text.replace("\n24\n", "\n23\n", 1))
    elif what == "signature":
        cp.write_text(_corrupt_sig(cp.read_text(), "bob"))
    elif what == "since":
        base.write_bytes(base.read_bytes().replace(b'"cpu-portable"', b'"cpu-portablE"', 1))
    v = agree(p, **kw)
    assert v["status"] == "fail", v


# ---- the verified-file cache: nowhere near the ledger -----------------------------------------------------------
def _listing(folder: Path) -> dict:
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.rglob("*"))} | {
        ".": folder.stat().st_mtime_ns
    }


def test_verify_leaves_the_ledger_folder_unchanged_and_the_cache_speeds_a_second_run(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    run, shared = tmp_path / "repo" / "ledger", tmp_path / "repo" / "examples"
    run.mkdir(parents=True)
    shared.mkdir()
    p = run / "ledger.jsonl"
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    payload = os.urandom(1 << 16)
    files = {
        run / "a.kvg": _zstd(payload),
        run / "prereg.yaml": b"x: 1\n",
        shared / "problems.jsonl": b"{}\n",
        shared / "outputs.jsonl": b"{}\n{}\n",
    }
    for f, data in files.items():
        f.write_bytes(data)
    for _ in range(3):  # the problems file named by every line: hashed once per run
        ledger.append(
            p,
            "test",
            {
                "inputs": {
                    "problems": {"path": "../examples/problems.jsonl", "sha256": sha(files[shared / "problems.jsonl"])}
                }
            },
        )
    ledger.append(
        p,
        "test",
        {
            "inputs": {
                "prereg": {"path": "prereg.yaml", "sha256": sha(b"x: 1\n")},
                "outputs": {"path": "../examples/outputs.jsonl", "sha256": sha(b"{}\n{}\n")},
            },
            "outputs": {"artifact": {"path": "a.kvg", "sha256": sha(payload)}},
        },
    )
    (p.parent / (p.name + ".lock")).unlink(missing_ok=True)  # the writer's lock, if left; verify takes none
    calls = []
    real = hashcache.raw_digest
    monkeypatch.setattr(hashcache, "raw_digest", lambda f: calls.append(f) or real(f))
    folders = [p.parent, p.parent.parent / "examples"]
    before = [_listing(f) for f in folders]

    assert verify_ledger(p).passed
    assert [_listing(f) for f in folders] == before  # nothing written beside the ledger
    first = len(calls)
    assert first == 4  # problems, outputs, prereg, the artifact
    cached = list((tmp_path / "xdg" / "kvgraft" / "verify").iterdir())
    assert [c.name for c in cached] == [hashlib.sha256(str(p.resolve()).encode()).hexdigest() + ".json"]
    calls.clear()
    assert verify_ledger(p).passed and calls == []  # every file from the cache
    assert verify_ledger(p, full=True).passed and len(calls) == first  # --full re-hashes
    calls.clear()
    assert verify_ledger(p, cache=False).passed and len(calls) == first  # --no-cache: nothing read ...
    own = tmp_path / "own-cache.json"
    assert verify_ledger(p, cache=own).passed and own.is_file()  # --cache FILE
    calls.clear()
    assert verify_ledger(p, cache=own).passed and calls == []
    assert [_listing(f) for f in folders] == before

    # A read-only ledger folder verifies the same, and the CLI writes nothing there either.
    for f in folders:
        f.chmod(0o555)
    try:
        r = run_cli(
            "verify", str(p), "--json", cwd=tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "xdg2")}, check_rc=0
        )
        assert json.loads(r.stdout)["passed"]
        assert len(list((tmp_path / "xdg2" / "kvgraft" / "verify").iterdir())) == 1
        run_cli(
            "verify", str(p), "--no-cache", cwd=tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "xdg3")}, check_rc=0
        )
        assert not (tmp_path / "xdg3").exists()  # ... and nothing written
    finally:
        for f in folders:
            f.chmod(stat.S_IRWXU)
    assert [_listing(f) for f in folders] == before


def test_cache_location_rules(tmp_path, monkeypatch):
    a, b = tmp_path / "a" / "l.jsonl", tmp_path / "b" / "l.jsonl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hashcache.default_cache_path(a).parent == tmp_path / "xdg" / "kvgraft" / "verify"
    assert hashcache.default_cache_path(a) != hashcache.default_cache_path(b)  # two ledgers, two caches
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/cache"):  # unset or relative: ignored, as the XDG spec says
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert hashcache.default_cache_path(a).parent == tmp_path / "home" / ".cache" / "kvgraft" / "verify"
    with pytest.raises(InputError):
        verify_ledger(_base_file(tmp_path), cache=tmp_path)  # --cache names a file, not a folder
    # A damaged cache is only a lost speed-up; an unwritable cache folder too.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    lp, _ = _files_ledger(tmp_path / "f")
    want = kvgraft_verdict(lp)
    cache = hashcache.default_cache_path(lp)
    cache.parent.mkdir(parents=True)
    for junk in ("null", "[]", '"s"', '{"x": 5}', "{", '{"/a": [1, 2, 3, 4]}'):
        cache.write_text(junk)
        assert verify_ledger(lp).files == verify_ledger(lp, cache=False).files
    (tmp_path / "xdg-file").mkdir()
    (tmp_path / "xdg-file" / "kvgraft").write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-file"))
    assert verify_ledger(lp).files == verify_ledger(lp, cache=False).files
    assert kvgraft_verdict(lp) == want


def _base_file(tmp_path: Path) -> Path:
    p = tmp_path / "c" / "l.jsonl"
    p.parent.mkdir()
    _base(p, 2)
    return p
