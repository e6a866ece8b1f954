"""Ledger checkpoints: a small text file that commits to the ledger's Merkle tree (size, root), optionally signed.

The formats are the transparency-log ones, byte for byte, so that standard tools can read and verify them:

* The checkpoint body follows C2SP ``tlog-checkpoint``::

      <origin>\\n
      <tree size, decimal, no leading zeros>\\n
      <base64 of the 32-byte RFC 6962 root hash>\\n
      [extension lines, each non-empty]\\n

* Signatures follow C2SP ``signed-note`` (as implemented by Go's ``golang.org/x/mod/sumdb/note``): the text
  (ending in a newline), one blank line, then one line per signature::

      — <key name> <base64(4-byte key hash || 64-byte Ed25519 signature)>\\n

  with an EM DASH (U+2014) and a space in front. The signature covers the text including its final newline,
  not the blank line. The key hash is ``SHA-256(key name || "\\n" || 0x01 || 32-byte public key)[:4]``.

* Keys are the ``note`` package's text encodings::

      verifier key:  <name>+<8 hex key hash>+<base64(0x01 || 32-byte Ed25519 public key)>
      signer key:    PRIVATE+KEY+<name>+<8 hex key hash>+<base64(0x01 || 32-byte Ed25519 seed)>

Only Ed25519 (signature type 0x01) is supported. ``cryptography`` is imported lazily, inside the functions that
generate keys, sign or verify, so reading and writing unsigned checkpoints works without it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ..errors import CheckFailed, InputError
from ..util.fsio import atomic_write_bytes

if TYPE_CHECKING:  # pragma: no cover - typing only
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

#: Signature type byte of Ed25519 in the signed-note spec.
ALG_ED25519 = 0x01
#: Prefix of every signature line: EM DASH (U+2014) and a space.
SIG_PREFIX = "\u2014 "
#: Prefix of a signer (private) key string.
PRIVATE_KEY_PREFIX = "PRIVATE+KEY+"
#: Most signature lines a note may carry (Go's ``note.Open`` limit; the spec requires accepting at least 16).
MAX_SIGNATURES = 100
#: Largest tree size we accept (tree sizes are unsigned 64-bit integers across the ecosystem).
MAX_TREE_SIZE = 2**64 - 1

_ROOT_SIZE = 32
_ED25519_KEY_SIZE = 32
_ED25519_SIG_SIZE = 64
_KEY_HASH_SIZE = 4
_SIZE_RE = re.compile(r"0|[1-9][0-9]*")
_HEX8_RE = re.compile(r"[0-9a-fA-F]{8}")
_CRYPTO_HINT = "install it with: pip install 'cryptography>=42'"


# --------------------------------------------------------------------------------------------------------------
# Checkpoint body


@dataclass(frozen=True)
class Checkpoint:
    """A tree head: the log's ``origin``, the tree ``size`` (number of leaves) and its 32-byte Merkle ``root``.

    ``extensions`` holds the optional extension lines of the tlog-checkpoint format (opaque, non-empty, not
    recommended); kvgraft writes none, but parsing keeps them so that :meth:`body` reproduces the signed text.
    """

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.origin, str) or not self.origin:
            raise InputError("checkpoint origin is empty", "the origin names the log, e.g. 'example.com/ledger'")
        if "\n" in self.origin:
            raise InputError("checkpoint origin contains a newline")
        _check_note_chars(self.origin, "checkpoint origin")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 0 <= self.size <= MAX_TREE_SIZE:
            raise InputError(f"checkpoint tree size {self.size!r} is not an integer in [0, 2^64-1]")
        if not isinstance(self.root, bytes) or len(self.root) != _ROOT_SIZE:
            raise InputError(f"checkpoint root hash must be {_ROOT_SIZE} bytes")
        for line in self.extensions:
            if not isinstance(line, str) or not line or "\n" in line:
                raise InputError("checkpoint extension lines must be non-empty single lines")
            if line.startswith(SIG_PREFIX):
                raise InputError(
                    "checkpoint has a signature line directly after its body",
                    "a blank line must separate the checkpoint text from its signature lines",
                )
            _check_note_chars(line, "checkpoint extension line")

    def body(self) -> str:
        """The note text: origin, size and base64 root hash (then any extension lines), each ending in newline."""
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode("ascii"), *self.extensions]
        return "".join(line + "\n" for line in lines)

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        """Parse a checkpoint from its body, or from a signed note carrying it (signatures are not verified).

        Validation is strict: the text must end with a newline; the origin must be non-empty; the size must be
        canonical decimal (no sign, no leading zeros except ``0`` itself); the root must be canonical base64 of
        exactly 32 bytes. Raises :class:`InputError` on any deviation.
        """
        if not isinstance(text, str):
            raise InputError("checkpoint must be text")
        if _looks_signed(text):
            text, _ = split_note(text)
        _check_note_chars(text, "checkpoint")
        if not text.endswith("\n"):
            raise InputError("checkpoint does not end with a newline", "every line, the last included, ends in '\\n'")
        lines = text[:-1].split("\n")
        if len(lines) < 3:
            raise InputError(
                f"checkpoint has {len(lines)} line(s); it needs at least 3",
                "origin, tree size and base64 root hash, one per line",
            )
        if any(line == "" for line in lines):
            raise InputError("checkpoint has an empty line", "only one blank line, before the signatures, is allowed")
        origin, size_text, root_text, *extensions = lines
        if not _SIZE_RE.fullmatch(size_text):
            raise InputError(
                f"checkpoint tree size {size_text!r} is not a canonical decimal",
                "digits only, no sign, no leading zeros (the empty tree is '0')",
            )
        root = _b64decode_strict(root_text, "checkpoint root hash")
        if len(root) != _ROOT_SIZE:
            raise InputError(f"checkpoint root hash decodes to {len(root)} bytes, not {_ROOT_SIZE}")
        return cls(origin=origin, size=int(size_text), root=root, extensions=tuple(extensions))


# --------------------------------------------------------------------------------------------------------------
# Keys


@dataclass(frozen=True)
class VerifierKey:
    """A parsed verifier key: the key name, its 4-byte key hash and the 32-byte Ed25519 public key."""

    name: str
    key_hash: bytes
    public_key: bytes

    def __str__(self) -> str:
        return _encode_key(self.name, self.key_hash, self.public_key)


@dataclass(frozen=True)
class SignerKey:
    """A parsed signer key: the key name, its 4-byte key hash (of the *public* key) and the 32-byte seed."""

    name: str
    key_hash: bytes
    seed: bytes

    def __repr__(self) -> str:  # never print the seed
        return f"SignerKey(name={self.name!r}, key_hash={self.key_hash.hex()!r}, seed=<hidden>)"

    def __str__(self) -> str:
        return PRIVATE_KEY_PREFIX + _encode_key(self.name, self.key_hash, self.seed)

    def verifier(self) -> VerifierKey:
        """The matching verifier key (derives the public key; needs ``cryptography``)."""
        public = _raw_public_key(_private_key(self.seed))
        return VerifierKey(self.name, self.key_hash, public)


def is_valid_key_name(name: str) -> bool:
    """Whether ``name`` is a valid key name: non-empty, no Unicode white space, no ``+``."""
    return bool(name) and "+" not in name and not any(ch.isspace() for ch in name) and _is_utf8(name)


def key_hash(name: str, public_key: bytes) -> bytes:
    """The 4-byte key hash of an Ed25519 key: ``SHA-256(name || "\\n" || 0x01 || public key)[:4]``."""
    data = name.encode("utf-8") + b"\n" + bytes([ALG_ED25519]) + public_key
    return hashlib.sha256(data).digest()[:_KEY_HASH_SIZE]


def generate_key(name: str) -> tuple[str, str]:
    """Generate a fresh Ed25519 key pair named ``name``; returns ``(signer key string, verifier key string)``.

    The signer key is a secret: anyone holding it can sign checkpoints under this name.
    """
    _check_key_name(name)
    ed25519 = _ed25519()
    private = ed25519.Ed25519PrivateKey.generate()
    seed = private.private_bytes_raw()
    public = _raw_public_key(private)
    h = key_hash(name, public)
    return str(SignerKey(name, h, seed)), str(VerifierKey(name, h, public))


def parse_verifier_key(vkey: str) -> VerifierKey:
    """Parse and check a verifier key string ``<name>+<8 hex>+<base64(0x01 || public key)>``.

    Raises :class:`InputError` when the shape, the algorithm byte, the key length or the key hash is wrong.
    """
    if not isinstance(vkey, str):
        raise InputError("verifier key must be a string")
    if vkey.startswith(PRIVATE_KEY_PREFIX):
        raise InputError("this is a signer (private) key, not a verifier key", "pass the public key string")
    name, h, public = _decode_key(vkey, "verifier key")
    if h != key_hash(name, public):
        raise InputError(
            f"verifier key {name}+{h.hex()}: the key hash does not match the public key",
            "the key string is corrupted or was edited",
        )
    return VerifierKey(name, h, public)


def parse_signer_key(skey: str) -> SignerKey:
    """Parse and check a signer key string ``PRIVATE+KEY+<name>+<8 hex>+<base64(0x01 || seed)>``.

    The key hash is checked against the public key derived from the seed, so this needs ``cryptography``.
    Raises :class:`InputError` on any malformation; messages never include the secret.
    """
    if not isinstance(skey, str):
        raise InputError("signer key must be a string")
    if not skey.startswith(PRIVATE_KEY_PREFIX):
        raise InputError(
            "signer key does not start with 'PRIVATE+KEY+'",
            "a signer key looks like PRIVATE+KEY+<name>+<8 hex>+<base64>; create one with generate_key",
        )
    name, h, seed = _decode_key(skey[len(PRIVATE_KEY_PREFIX) :], "signer key")
    key = SignerKey(name, h, seed)
    if h != key_hash(name, key.verifier().public_key):
        raise InputError(
            f"signer key {name}+{h.hex()}: the key hash does not match the key",
            "the key string is corrupted or was edited",
        )
    return key


def verifier_key(signer_key: str) -> str:
    """The verifier key string matching a signer key string (what to hand to whoever verifies)."""
    return str(parse_signer_key(signer_key).verifier())


def load_key(path_or_string: str | os.PathLike[str]) -> str:
    """A key string from a file, or the argument itself.

    If ``path_or_string`` names an existing file, its content (stripped of surrounding white space) is the key;
    otherwise the argument is taken as the key string. The key is not parsed here.
    """
    text = os.fspath(path_or_string)
    if os.path.isfile(text):
        try:
            key = Path(text).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read key file {text}: {exc}") from exc
        if not key:
            raise InputError(f"key file {text} is empty")
        return key
    key = text.strip()
    if not key:
        raise InputError("empty key", "pass a key string or the path of a file holding one")
    return key


# --------------------------------------------------------------------------------------------------------------
# Signed notes


@dataclass(frozen=True)
class NoteSignature:
    """One signature line of a note: key name, 4-byte key hash and the signature bytes that follow it."""

    name: str
    key_hash: bytes
    signature: bytes

    def line(self) -> str:
        """The signature line, newline included."""
        payload = base64.b64encode(self.key_hash + self.signature).decode("ascii")
        return f"{SIG_PREFIX}{self.name} {payload}\n"


def split_note(note: str) -> tuple[str, list[NoteSignature]]:
    """Split a signed note into its text (final newline included) and its signature lines, checking the syntax.

    The text ends at the *last* blank line, as the spec says. Raises :class:`InputError` when there is no blank
    line, no signature line, a line that is not a well-formed signature line, a bad key name, bad base64, or
    more than :data:`MAX_SIGNATURES` signatures. Signatures are not verified here.
    """
    if not isinstance(note, str):
        raise InputError("note must be text")
    _check_note_chars(note, "note")
    split = note.rfind("\n\n")
    if split < 0:
        raise InputError(
            "note has no blank line before its signatures",
            "a signed note is its text, one empty line, then lines starting with '\u2014 '",
        )
    text, block = note[: split + 1], note[split + 2 :]
    if not block:
        raise InputError("note has no signature lines after its blank line")
    if not block.endswith("\n"):
        raise InputError("note does not end with a newline", "the last signature line must end in '\\n'")
    lines = block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise InputError(f"note has {len(lines)} signature lines; at most {MAX_SIGNATURES} are accepted")
    signatures = []
    for number, line in enumerate(lines, start=1):
        if not line.startswith(SIG_PREFIX):
            raise InputError(
                f"signature line {number} does not start with an em dash and a space",
                "signature lines look like '\u2014 <key name> <base64>' (U+2014 EM DASH)",
            )
        name, _, payload = line[len(SIG_PREFIX) :].partition(" ")
        if not is_valid_key_name(name):
            raise InputError(f"signature line {number}: invalid key name {name!r}")
        raw = _b64decode_strict(payload, f"signature line {number}")
        if len(raw) <= _KEY_HASH_SIZE:
            raise InputError(f"signature line {number} is too short to hold a key hash and a signature")
        signatures.append(NoteSignature(name, raw[:_KEY_HASH_SIZE], raw[_KEY_HASH_SIZE:]))
    return text, signatures


def sign(body: str, signer_key: str) -> str:
    """Sign a note text (e.g. :meth:`Checkpoint.body`) and return the signed note.

    If ``body`` already is a signed note, the new signature line is appended after the existing ones
    (co-signing); an existing signature by the same key (same name and key hash) is replaced. The text must end
    with a newline and follow the note rules (UTF-8, no control characters but newline). Needs ``cryptography``.
    """
    key = parse_signer_key(signer_key)
    if _looks_signed(body):
        text, existing = split_note(body)
    else:
        text, existing = body, []
    _check_note_chars(text, "note text")
    if not text.endswith("\n"):
        raise InputError("note text does not end with a newline", "a note's last line ends in '\\n' too")
    signature = _private_key(key.seed).sign(text.encode("utf-8"))
    kept = [s for s in existing if (s.name, s.key_hash) != (key.name, key.key_hash)]
    new = NoteSignature(key.name, key.key_hash, signature)
    return text + "\n" + "".join(s.line() for s in [*kept, new])


def verify_note(note: str, verifier_keys: list[str]) -> list[str]:
    """Verify a signed note against trusted verifier keys; return the names of the keys whose signatures verify.

    As the signed-note spec says: signature lines whose (name, key hash) match no given key are ignored; every
    line that matches a given key must verify, or the whole note is rejected. Raises :class:`CheckFailed` when a
    known key's signature is invalid or when no given key signed the note; :class:`InputError` when the note or
    a key string is malformed. Needs ``cryptography`` (only when a signature is to be checked).
    """
    if isinstance(verifier_keys, str):
        raise InputError("verifier_keys must be a list of key strings, not one string")
    known: dict[tuple[str, bytes], VerifierKey] = {}
    for vkey in verifier_keys:
        parsed = parse_verifier_key(vkey)
        previous = known.setdefault((parsed.name, parsed.key_hash), parsed)
        if previous.public_key != parsed.public_key:
            raise InputError(
                f"two different verifier keys share the name and key hash {parsed.name}+{parsed.key_hash.hex()}"
            )
    if not known:
        raise InputError("no verifier key given", "pass the verifier key(s) you trust")
    text, signatures = split_note(note)
    message = text.encode("utf-8")
    verified: list[str] = []
    for sig in signatures:
        key = known.get((sig.name, sig.key_hash))
        if key is None:
            continue  # unknown key: ignored, as the spec requires
        if not _ed25519_verify(key.public_key, sig.signature, message):
            raise CheckFailed(
                f"invalid signature by key {key.name}+{key.key_hash.hex()}",
                "the note was altered after signing, or the signature line is corrupted",
            )
        if key.name not in verified:
            verified.append(key.name)
    if not verified:
        present = ", ".join(f"{s.name}+{s.key_hash.hex()}" for s in signatures)
        raise CheckFailed(
            "no trusted key signed this note",
            f"the note is signed by {present}; pass the matching verifier key if you trust it",
        )
    return verified


# --------------------------------------------------------------------------------------------------------------
# Files


def read_checkpoint(path: str | os.PathLike[str]) -> str:
    """Read a checkpoint file (signed or not) and return its text, after checking that it parses.

    Raises :class:`InputError` when the file is missing, not UTF-8, or not a well-formed checkpoint.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"checkpoint {path} is not UTF-8") from exc
    try:
        Checkpoint.parse(text)
    except InputError as exc:
        raise InputError(f"{path}: {exc.message}", exc.hint) from exc
    return text


def write_checkpoint(path: str | os.PathLike[str], text: str) -> None:
    """Write a checkpoint (signed or not) atomically, after checking that it parses."""
    Checkpoint.parse(text)
    atomic_write_bytes(Path(path), text.encode("utf-8"))


# --------------------------------------------------------------------------------------------------------------
# Internals


def _looks_signed(text: str) -> bool:
    """Whether ``text`` has a signature block: a blank line followed by a line starting with the em-dash prefix."""
    split = text.rfind("\n\n")
    return split >= 0 and text.startswith(SIG_PREFIX, split + 2)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


def _check_note_chars(text: str, what: str) -> None:
    """Notes must be valid UTF-8 with no ASCII control character other than newline."""
    if not _is_utf8(text):
        raise InputError(f"{what} is not valid UTF-8")
    for ch in text:
        if ch < " " and ch != "\n":
            raise InputError(
                f"{what} contains the control character {ch!r}", "notes allow no control characters but '\\n'"
            )


def _check_key_name(name: str) -> None:
    if not isinstance(name, str) or not is_valid_key_name(name):
        raise InputError(
            f"invalid key name {name!r}",
            "a key name is non-empty, without spaces or '+'; use the log's origin, e.g. example.com/ledger",
        )


def _b64decode_strict(text: str, what: str) -> bytes:
    """Standard base64 with padding, and canonical (re-encoding gives the same text)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
        raise InputError(f"{what}: invalid base64") from exc
    if base64.b64encode(raw).decode("ascii") != text:
        raise InputError(f"{what}: non-canonical base64")
    return raw


def _encode_key(name: str, h: bytes, key: bytes) -> str:
    return f"{name}+{h.hex()}+{base64.b64encode(bytes([ALG_ED25519]) + key).decode('ascii')}"


def _decode_key(text: str, what: str) -> tuple[str, bytes, bytes]:
    """Split ``<name>+<8 hex>+<base64(0x01 || 32 bytes)>`` into (name, 4-byte hash, 32 key bytes)."""
    parts = text.split("+", 2)  # base64 may itself contain '+': only the first two separate fields
    if len(parts) != 3:
        raise InputError(f"malformed {what}", "expected <name>+<8 hex digits>+<base64>")
    name, hex_hash, b64 = parts
    _check_key_name(name)
    if not _HEX8_RE.fullmatch(hex_hash):
        raise InputError(f"malformed {what}: the key hash {hex_hash!r} is not 8 hex digits")
    data = _b64decode_strict(b64, what)
    if not data:
        raise InputError(f"malformed {what}: no key data")
    if data[0] != ALG_ED25519:
        raise InputError(f"{what} uses unknown algorithm {data[0]:#04x}", "only Ed25519 (0x01) is supported")
    if len(data) != 1 + _ED25519_KEY_SIZE:
        raise InputError(f"malformed {what}: Ed25519 key is {len(data) - 1} bytes, not {_ED25519_KEY_SIZE}")
    return name, bytes.fromhex(hex_hash), data[1:]


def _ed25519() -> ModuleType:
    """The ``cryptography`` Ed25519 module, imported on first use."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise InputError("signing and verifying checkpoints needs the 'cryptography' package", _CRYPTO_HINT) from exc
    return ed25519


def _private_key(seed: bytes) -> Ed25519PrivateKey:
    return _ed25519().Ed25519PrivateKey.from_private_bytes(seed)


def _raw_public_key(private: Ed25519PrivateKey) -> bytes:
    return private.public_key().public_bytes_raw()


def _ed25519_verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    if len(signature) != _ED25519_SIG_SIZE:
        return False
    ed25519 = _ed25519()
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except InvalidSignature:
        return False
    return True
