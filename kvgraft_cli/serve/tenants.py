"""API keys and tenants of `kvgraft serve`: who may ask, and whose prompt cache a request reads and writes.

**Keys.** ``--api-key KEY`` (repeatable), ``--api-key-file FILE`` (one key a line; blank lines and ``#`` comments
skipped) and the ``KVGRAFT_API_KEY`` environment variable give the keys a server takes, as OpenAI's clients send
them (``Authorization: Bearer KEY``). A request to ``/v1/...`` without one of them is a 401 in OpenAI's error shape.
The presented key is compared with every key, each by :func:`hmac.compare_digest` over SHA-256 digests (equal
lengths, no early exit), so the time taken says nothing about how much of a key was right, or which.

**Tenants.** A key is a tenant, named in ledger lines by :func:`tenant_id` (a hash: the key itself is never written).
A request's prompt-cache chunks are found and deposited under a *scope*: its tenant and the request's
``cache_salt`` (vLLM's field, for clients that share a key but not a cache). The scope is part of every chunk key of
the chain (store.local.prompt_key), so a chunk one scope deposited is never a hit for another: a second tenant's
first request on a prompt takes a cold request's time, and timing its first token says nothing about what another
tenant sent (the prompt-cache timing side channel). A scope's chunks also name it in their metadata, so they are
objects of its own: two tenants' identical chunks share no file and no place in the process's verified memory (a
warm request restored from memory another tenant filled would be faster, and say that the other sent it). Library
answers are verified solutions, public by nature, and stay shared. A server without keys and a request without a salt have no scope:
the keys a server always used.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from ..errors import InputError
from ..util.hashing import sha256_json

ENV_KEY = "KVGRAFT_API_KEY"


def tenant_id(key: str) -> str:
    """A key's name in ledger lines and scopes: the first 16 hex digits of its SHA-256 (never the key)."""
    return hashlib.sha256(b"kvgraft-tenant\0" + key.encode()).hexdigest()[:16]


def scope(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prompt-cache scope of a request (64 hex), or None for a server without keys and a request without salt."""
    if tenant is None and cache_salt is None:
        return None
    return sha256_json({"tenant": tenant, "cache_salt": cache_salt})


class Keys:
    """The keys a server takes (empty: no authentication). :meth:`tenant` checks a request's header."""

    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._tenants = [tenant_id(k) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of a request's ``Authorization`` header; None when the server takes no keys. Raises
        PermissionError (the app answers 401) for a missing or wrong key."""
        if not self._digests:
            return None
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise PermissionError("no API key: send it as 'Authorization: Bearer KEY'")
        digest = hashlib.sha256(presented.strip().encode()).digest()
        found = None
        for i, d in enumerate(self._digests):  # every key compared, whichever matches: no early exit
            if hmac.compare_digest(digest, d):
                found = self._tenants[i]
        if found is None:
            raise PermissionError("incorrect API key provided")
        return found


def load_keys(keys: list[str] | None, key_file: Path | None, environ: dict[str, str] | None = None) -> Keys:
    """The keys from ``--api-key`` values, ``--api-key-file`` and ``KVGRAFT_API_KEY``; InputError naming the file and
    line of a key that cannot be one (empty, or with whitespace inside)."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, str]] = [(k, "--api-key") for k in keys or []]
    if env.get(ENV_KEY, "").strip():
        found.append((env[ENV_KEY].strip(), ENV_KEY))
    if key_file is not None:
        try:
            text = Path(key_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read --api-key-file {key_file}: {e}", "one key a line") from None
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                found.append((line, f"{key_file}:{n}"))
        if not any(where.startswith(f"{key_file}:") for _, where in found):
            raise InputError(f"--api-key-file {key_file} holds no key", "one key a line; # starts a comment")
    for key, where in found:
        if not key or any(c.isspace() for c in key) or not key.isprintable():
            raise InputError(f"{where}: an API key must be printable, without spaces", "one key a line")
    return Keys([k for k, _ in found])


def is_loopback(host: str) -> bool:
    """Whether a listening address reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
