"""The S3 transport of a remote store: ``s3://bucket/prefix`` on any S3-compatible object store, through boto3.

This module only moves bytes and names; what the keys mean (objects, index batches) is :mod:`.remote`'s business.
boto3 is imported inside :class:`S3Remote` (the ``s3`` extra): without it a remote store is one InputError line.

Credentials and the endpoint come only from boto3's own chain: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared config and credentials files, instance and container roles;
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (or ``endpoint_url`` in the config file) for a server other than
AWS. kvgraft never reads, prints or records a credential: every error from S3 becomes one :class:`StoreError` line
naming the URL, the operation and the server's error code, with any credential value the message might echo
blanked out, and with the user information (``user:password@``) of any endpoint URL taken out of it.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import InputError, StoreError

SCHEME = "s3://"
# Largest object one PUT may carry (S3's limit); a larger file goes up in parts (boto3's transfer manager).
SINGLE_PUT_MAX = 5 * 1024**3
CHUNK = 8 * 1024 * 1024
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$")  # S3's rule, loosened a little for S3-compatible servers


def is_remote(ref: object) -> bool:
    """Whether a store reference names a remote store (``s3://...``) rather than a folder."""
    return isinstance(ref, str) and ref.startswith(SCHEME)


@dataclass(frozen=True)
class S3URL:
    """``s3://bucket/prefix``: the bucket, and the key prefix every key of the store starts with ("" or ending in /)."""

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, rel: str) -> str:
        return self.prefix + rel

    def url(self, rel: str) -> str:
        return f"{SCHEME}{self.bucket}/{self.key(rel)}"


def parse_url(url: str) -> S3URL:
    """Split ``s3://bucket[/prefix]``; refuse anything else with an InputError that shows the expected form."""
    if not is_remote(url):
        raise InputError(f"not an S3 URL: {url!r}", "a remote store is s3://BUCKET/PREFIX")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    parts = [p for p in prefix.split("/") if p]
    if not _BUCKET.match(bucket) or any(p in (".", "..") for p in parts):
        raise InputError(
            f"not a usable S3 URL: {url!r}",
            "a remote store is s3://BUCKET/PREFIX (a bucket name of lower-case letters, digits, dots and hyphens)",
        )
    return S3URL(bucket, "".join(p + "/" for p in parts))


_USERINFO = re.compile(r"(?<=://)[^/\s]*@")  # the user:password@ of a URL (up to the last @ before its path)


def redact(text: str) -> str:
    """``text`` with the user information (``user:password@``) of every URL in it taken out, and that of the
    endpoints the environment names blanked out wherever else it appears (a password holding a "/" or a space)."""
    for url in (os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL")):
        userinfo = url.split("://", 1)[-1].rpartition("@")[0] if url and "@" in url else ""
        if userinfo:
            text = text.replace(userinfo + "@", "").replace(userinfo, "***")
            password = userinfo.partition(":")[2]
            if len(password) >= 4:
                text = text.replace(password, "***")
    return _USERINFO.sub("", text)


def endpoint_hint() -> str:
    """The endpoint as the environment names it ("" for AWS or one set in a config file): part of a remote cache's
    name, so the same bucket and prefix on two servers never share a cache."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""


def file_digests(path: Path) -> tuple[str, bytes, bytes, int]:
    """(SHA-256 hex, SHA-256 raw, MD5 raw, size) of a file in one pass: what an upload sends for the server to check."""
    sha, md5, n = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            md5.update(chunk)
            n += len(chunk)
    return sha.hexdigest(), sha.digest(), md5.digest(), n


class S3Remote:
    """One ``s3://bucket/prefix``: HEAD, PUT (only where absent), GET and LIST of keys under the prefix."""

    def __init__(self, url: str):
        self.where = parse_url(url)
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise InputError(
                f"the remote store {self.where} needs boto3, which is not installed here", "pip install 'kvgraft[s3]'"
            ) from None
        # Few, quick retries: an endpoint that is down should fail in seconds, not after botocore's minutes.
        config = Config(
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            user_agent_extra="kvgraft",
        )
        with self.errors("connect to"):
            try:
                self.client = boto3.session.Session().client("s3", config=config)
            except ValueError as e:  # botocore: "Invalid endpoint: ..." (and urllib's "Invalid IPv6 URL")
                named = endpoint_hint()
                what = repr(redact(named)) if named else "the endpoint_url of the AWS config file"
                raise StoreError(
                    f"cannot connect to {self.where}: {what} is not a usable endpoint URL ({redact(str(e))})",
                    "set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) to http(s)://HOST[:PORT], or unset it for AWS",
                ) from None
        self.endpoint = redact(self.client.meta.endpoint_url or "") or None

    def __str__(self) -> str:
        return str(self.where)

    def errors(self, doing: str, rel: str = "") -> _s3_errors:
        return _s3_errors(self, doing, rel)

    def head(self, rel: str) -> dict | None:
        """The object's HEAD (size, metadata), or None when there is none."""
        from botocore.exceptions import ClientError

        with self.errors("read", rel):
            try:
                return self.client.head_object(Bucket=self.where.bucket, Key=self.where.key(rel))
            except ClientError as e:
                if _code(e) in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise

    def put_file(self, rel: str, path: Path, metadata: dict[str, str]) -> str | None:
        """Upload a file unless the key exists; returns the file's SHA-256 (hex, recorded in the object's metadata as
        ``file-sha256``) when this call wrote it, else None. The body's SHA-256 (and MD5) go
        with it, so a server that checks them refuses a body damaged on the way (BadDigest), and the PUT is
        conditional (If-None-Match: *), so two writers never overwrite one another's object."""
        sha_hex, sha_raw, md5_raw, size = file_digests(path)
        meta = {**metadata, "file-sha256": sha_hex}
        key = self.where.key(rel)
        with self.errors("write", rel):
            if size > SINGLE_PUT_MAX:
                from boto3.s3.transfer import TransferConfig

                # Past one PUT's limit: parts, each with its SHA-256 checked by the server; no conditional PUT in
                # the transfer manager, so a concurrent writer may replace it (with the same payload: same identity).
                self.client.upload_file(
                    str(path),
                    self.where.bucket,
                    key,
                    ExtraArgs={"Metadata": meta, "ChecksumAlgorithm": "SHA256"},
                    Config=TransferConfig(multipart_threshold=SINGLE_PUT_MAX, multipart_chunksize=256 * 1024**2),
                )
                return sha_hex
            with open(path, "rb") as body:
                return sha_hex if self._put(key, body, size, sha_raw, md5_raw, meta) else None

    def put_bytes(self, rel: str, data: bytes, metadata: dict[str, str] | None = None) -> bool:
        """Upload bytes unless the key exists (see :meth:`put_file`); returns whether this call wrote them."""
        with self.errors("write", rel):
            return self._put(
                self.where.key(rel),
                data,
                len(data),
                hashlib.sha256(data).digest(),
                hashlib.md5(data, usedforsecurity=False).digest(),
                {**(metadata or {}), "file-sha256": hashlib.sha256(data).hexdigest()},
            )

    def _put(self, key: str, body, size: int, sha_raw: bytes, md5_raw: bytes, meta: dict[str, str]) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(
                Bucket=self.where.bucket,
                Key=key,
                Body=body,
                ContentLength=size,
                ContentMD5=base64.b64encode(md5_raw).decode(),
                ChecksumSHA256=base64.b64encode(sha_raw).decode(),
                Metadata=meta,
                IfNoneMatch="*",
            )
        except ClientError as e:
            if _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False  # someone has it already (content-addressed or uniquely named: the same bytes)
            raise
        return True

    def get_to(self, rel: str, f: BinaryIO) -> int:
        """Stream an object into an open file; returns the bytes written. A missing key is ``FileNotFoundError``."""
        from botocore.exceptions import ClientError

        n = 0
        with self.errors("read", rel):
            try:
                body = self.client.get_object(Bucket=self.where.bucket, Key=self.where.key(rel))["Body"]
            except ClientError as e:
                if _code(e) in ("404", "NoSuchKey", "NotFound"):
                    raise FileNotFoundError(self.where.url(rel)) from None
                raise
            for chunk in body.iter_chunks(CHUNK):
                f.write(chunk)
                n += len(chunk)
        return n

    def get_bytes(self, rel: str, limit: int) -> bytes:
        """An object's bytes, refused past ``limit`` bytes (index batches are small; a huge one is not ours)."""
        import io

        head = self.head(rel)
        if head is None:
            raise FileNotFoundError(self.where.url(rel))
        if head["ContentLength"] > limit:
            raise StoreError(
                f"{self.where.url(rel)} is {head['ContentLength']} bytes, more than an index batch may be ({limit})"
            )
        buf = io.BytesIO()
        self.get_to(rel, buf)
        return buf.getvalue()

    def list(self, rel_prefix: str, start_after: str = "") -> Iterator[tuple[str, int]]:
        """(key relative to the store, size) of every object under ``rel_prefix``, in key order, after
        ``start_after`` (a relative key)."""
        kw = {"Bucket": self.where.bucket, "Prefix": self.where.key(rel_prefix)}
        if start_after:
            kw["StartAfter"] = self.where.key(start_after)
        with self.errors("list"):
            for page in self.client.get_paginator("list_objects_v2").paginate(**kw):
                for obj in page.get("Contents", ()):
                    yield obj["Key"][len(self.where.prefix) :], obj["Size"]

    def _secrets(self) -> builtins.list[str]:  # (builtins: the method ``list`` above shadows the type here)
        """The credential strings an error message must never show (never printed, only blanked out)."""
        try:
            creds = self.client._request_signer._credentials  # what signed the request, whatever its source
            frozen = creds.get_frozen_credentials() if creds else None
        except Exception:
            return []
        return [
            v
            for v in (
                getattr(frozen, "access_key", None),
                getattr(frozen, "secret_key", None),
                getattr(frozen, "token", None),
            )
            if v
        ]


def _code(e) -> str:
    return str(e.response.get("Error", {}).get("Code", "")) if hasattr(e, "response") else ""


# Error codes and what they mean to a user, for one clear line.
_MEANINGS = {
    "NoSuchBucket": "the bucket does not exist",
    "InvalidAccessKeyId": "access denied: the server does not know this access key",
    "SignatureDoesNotMatch": "access denied: the secret key does not match the access key",
    "AccessDenied": "access denied",
    "403": "access denied",
    "InvalidToken": "access denied: the session token is not valid",
    "ExpiredToken": "access denied: the session token has expired",
    "BadDigest": "the server received other bytes than were sent (checksum mismatch); nothing was stored",
    "XAmzContentSHA256Mismatch": "the server received other bytes than were sent (checksum mismatch)",
}


class _s3_errors:
    """Turn boto3's and botocore's exceptions into one StoreError line naming the URL (never a traceback, never a
    credential)."""

    def __init__(self, remote: S3Remote | None, doing: str, rel: str = ""):
        self.remote, self.doing, self.rel = remote, doing, rel

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or isinstance(exc, (StoreError, FileNotFoundError)):
            return False
        try:
            from botocore.exceptions import (
                BotoCoreError,
                ClientError,
                EndpointConnectionError,
                NoCredentialsError,
                PartialCredentialsError,
            )
        except ImportError:
            return False
        if not isinstance(exc, (BotoCoreError, ClientError)):
            return False
        r = self.remote
        where = (r.where.url(self.rel) if self.rel else str(r.where)) if r and hasattr(r, "where") else "S3"
        endpoint = getattr(r, "endpoint", None) or "the default AWS endpoint"
        hint = None
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            reason = "no AWS credentials found"
            hint = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (the standard AWS credential chain)"
        elif isinstance(exc, EndpointConnectionError) or type(exc).__name__ in (
            "ConnectTimeoutError",
            "ReadTimeoutError",
        ):
            reason = f"cannot reach the endpoint {endpoint}"
            hint = "check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and that the server is up"
        elif isinstance(exc, ClientError):
            code = _code(exc)
            message = exc.response.get("Error", {}).get("Message") or ""
            reason = _MEANINGS.get(code, f"the server answered {code or 'an error'}")
            if code not in _MEANINGS and message:
                reason += f": {message}"
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
                hint = "check the credentials (the standard AWS chain) and the bucket's policy"
            elif code == "NoSuchBucket":
                hint = "create the bucket, or check the URL and the endpoint (AWS_ENDPOINT_URL)"
        else:
            reason = str(exc)
        for secret in r._secrets() if isinstance(r, S3Remote) and hasattr(r, "client") else []:
            reason = reason.replace(secret, "***")
        raise StoreError(f"cannot {self.doing} {where}: {redact(reason)}", hint) from None
