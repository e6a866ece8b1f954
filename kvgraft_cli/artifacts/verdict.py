"""The one place that decides what a refused ``.kvg`` file means: damaged (a failed check, exit 1) or bad input
(exit 2). Torch-free.

A reader refuses a file for what its structure shows: a frame or container that breaks the rules, a header that is
not a kvgraft artifact or is inconsistent, a header past the model's positions. The structure alone cannot tell a
damaged artifact from a file that never was one: a flipped byte can turn a metadata key into another, or the
magic into text. What can tell is an identity the file is recorded under: a reference resolved through the store,
or a file named by its hash. Every reader that has one hands its refusal to :func:`judge`, so the same bytes get
the same exit code whichever way they were named (by hash, by prefix, by path), and the same verdict `kvgraft
verify` gives them (audit.hashcache.raw_digest):

- :class:`IntegrityError` stays (exit 1), and :class:`PayloadTooLarge` stays (exit 2: a setting, docs/FORMAT.md,
  "Reader limits"; a header cannot tell a 64 GiB bomb from a genuine 64 GiB artifact, and the hint says how to
  read the latter).
- With no identity to check against, every refusal stands (a file that is not an artifact is bad input).
- With one, a file that cannot be opened stays bad input (missing, a directory, unreadable); otherwise the payload
  is re-hashed in a streamed pass under the reader limits (bounded memory, whatever the file declares). Bytes that
  cannot be hashed as an artifact, or hash to anything else, are damage: an :class:`IntegrityError` naming the
  file, with the first refusal's reason. Bytes that do hash to the identity are the recorded artifact, refused for
  a reason of its own (another model, a format this kvgraft does not read): the refusal stands (exit 2).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ArtifactError, IntegrityError, KvgraftError, ModelMismatch, PayloadTooLarge

_HINT = "delete it and re-deposit, or re-import it from a good copy"


def judge(exc: KvgraftError, path: Path | str, expected_sha256: str | None) -> KvgraftError:
    """The error to raise for ``exc``, a refusal of the file at ``path`` which is recorded under
    ``expected_sha256`` (None: no identity to check against). See the module docstring for the rule."""
    if expected_sha256 is None or isinstance(exc, (IntegrityError, PayloadTooLarge)):
        return exc
    if not isinstance(exc, (ArtifactError, ModelMismatch)):
        return exc
    path = Path(path)
    try:
        with open(path, "rb"):
            pass
    except OSError:  # missing, a directory, unreadable: the reference is bad, nothing was checked
        return exc
    from .payload import kvg_payload_sha256

    try:
        got = kvg_payload_sha256(path)
    except PayloadTooLarge as e:
        return e
    except IntegrityError as e:
        return IntegrityError(f"{exc.message} ({_reason(e, path)})", e.hint or _HINT)
    except ArtifactError as e:  # not a .kvg frame at all, an unknown codec or identity scheme
        return IntegrityError(
            f"{exc.message} (its bytes cannot be hashed as the artifact {expected_sha256[:16]}... it is recorded "
            f"as: {_reason(e, path)})",
            _HINT,
        )
    if got != expected_sha256:
        return IntegrityError(
            f"{exc.message} (content hash {got[:16]}... does not match its identity {expected_sha256[:16]}...: "
            "tampered or corrupt)",
            _HINT,
        )
    return exc


@contextmanager
def judged(path: Path | str, expected_sha256: str | None) -> Iterator[None]:
    """Around a read of ``path``: a refusal raised inside is replaced by :func:`judge`'s verdict on it."""
    try:
        yield
    except (ArtifactError, ModelMismatch) as exc:
        verdict = judge(exc, path, expected_sha256)
        if verdict is exc:
            raise
        raise verdict from exc


def _reason(e: KvgraftError, path: Path) -> str:
    """``e``'s message without the file name it starts with (the outer message names the file already)."""
    msg = e.message
    prefix = f"{path}: "
    return (msg[len(prefix) :] if msg.startswith(prefix) else msg).rstrip(".")
