"""The one exception hierarchy of kvgraft.

Every failure a user can cause or meet is a :class:`KvgraftError`. The CLI turns it into one line on stderr,
``Error: <message>`` followed by ``Hint: <hint>`` when there is one, and exits with :attr:`exit_code`:

- 1: a check ran and found a difference (:class:`CheckFailed`): bytes that do not hash to what they must, whoever
  finds them. A tampered, truncated or corrupt artifact is :class:`IntegrityError` (exit 1) whether `graft`,
  `probe`, `replay` or `verify` meets it, and whether it was named by its hash or by its path, so "exit 1" always
  means "something is not what it was recorded to be". A refusal of a file that an identity is recorded for is
  judged in one place, kvgraft_cli/artifacts/verdict.py: bytes that are not that artifact are damage, however
  their header reads; a payload over ``KVGRAFT_MAX_PAYLOAD`` stays :class:`PayloadTooLarge` (exit 2).
- 2: bad input or usage (:class:`InputError`): a file that is missing or malformed, a manifest that does not
  validate, an artifact made for another model, an option the command does not take.
- 130: interrupted (Ctrl-C; :class:`Interrupted` when the command can say what it kept and how to resume).
"""

from __future__ import annotations


class KvgraftError(Exception):
    """Base of all kvgraft errors."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class InputError(KvgraftError):
    """Bad input or usage: a missing file, malformed YAML/JSONL, a manifest that does not validate."""

    exit_code = 2


class ManifestError(InputError):
    """A run-manifest that cannot be read or does not validate against the schema."""

    def __init__(self, message: str, hint: str | None = None, problems: list[str] | None = None):
        super().__init__(message, hint)
        self.problems = problems or []


class ProblemFileError(InputError):
    """A problems JSONL file with a malformed line or a missing field."""


class ArtifactError(InputError):
    """An artifact that is missing or not a kvgraft artifact (exit 2); :class:`IntegrityError`, a subclass, is one
    that is truncated or tampered with (exit 1). artifacts.verdict turns the former into the latter for a file
    recorded under an identity it does not hash to."""


class PayloadTooLarge(ArtifactError):
    """An artifact whose frame or container declares a payload larger than ``KVGRAFT_MAX_PAYLOAD``: bad input (exit
    2) wherever it is met, `kvgraft verify` included, never a mismatch (docs/LEDGER.md, docs/FORMAT.md)."""


class IntegrityError(ArtifactError):
    """An artifact whose bytes are damaged or differ from its identity (tampered, truncated, corrupt): a failed
    check, exit 1, the same as `kvgraft verify` reports for it."""

    exit_code = 1


class ModelMismatch(InputError):
    """An artifact or manifest that belongs to another model, tokenizer, dtype or layer layout."""


class KernelMismatch(ModelMismatch):
    """An artifact computed by other kernels than this machine's under the same manifest (config.kernels): its bits
    are not what a fresh computation here gives."""


class UnsupportedModel(InputError):
    """A model whose cache holds state kvgraft cannot deposit exactly (linear attention, quantized, ...)."""


class DriftError(InputError):
    """The effective environment differs from the manifest's pin (versions, device, kernel flags, model hash)."""


class DeviceError(InputError):
    """The manifest asks for a device this machine does not have."""


class StoreError(InputError):
    """A store that cannot be opened or written (read-only, disk full, permissions); nothing is left half-written."""


class LedgerError(InputError):
    """A ledger that cannot be appended to (torn last line, unreadable)."""


class Interrupted(KvgraftError):
    """The user interrupted a command (Ctrl-C): exit 130, the message saying what was kept and how to resume."""

    exit_code = 130


class CheckFailed(KvgraftError):
    """A check ran and found a difference (hash mismatch, an inexact graft)."""

    exit_code = 1


def engine_not_installed(exc: ImportError) -> InputError:
    """The error for an engine command on an install without torch (the core install has none)."""
    return InputError(
        f"this command needs the torch engine, which is not installed here ({exc})",
        "pip install torch==2.13.0 'kvgraft[engine]' (verify, ledger and manifest commands need neither)",
    )
