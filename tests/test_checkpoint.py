"""Checkpoints: C2SP tlog-checkpoint bodies in C2SP signed notes, signed and verified with Ed25519.

Known-answer vectors come from Go's reference implementation, golang.org/x/mod/sumdb/note (the package
documentation and note_test.go: TestSign, TestOpen, TestNewVerifier), and from the example in the C2SP
tlog-checkpoint specification. Ed25519 is deterministic, so our signature over the same text with the same key
must equal Go's byte for byte.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys

import pytest

from kvgraft_cli.errors import CheckFailed, InputError
from kvgraft_cli.ledger.checkpoint import (
    Checkpoint,
    generate_key,
    key_hash,
    load_key,
    parse_signer_key,
    parse_verifier_key,
    read_checkpoint,
    sign,
    split_note,
    verifier_key,
    verify_note,
    write_checkpoint,
)

# --- Known-answer vectors: golang.org/x/mod/sumdb/note (note.go package doc, note_test.go) ----------------------
GO_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_ENOCH_VKEY = "EnochRoot+af0cfe78+ATtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
GO_TEXT = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
GO_PETER_SIG = (
    "\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
)
GO_ENOCH_SIG = (
    "\u2014 EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWLox33WWd1RvMc+QQ=\n"
)

# --- Example from the C2SP tlog-checkpoint spec (c2sp.org/tlog-checkpoint); its public key is not published ------
SPEC_CHECKPOINT = (
    "example.com/behind-the-sofa\n"
    "20852163\n"
    "CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
    "\n"
    "\u2014 example.com/behind-the-sofa "
    "Az3grlgtzPICa5OS8npVmf1Myq/5IZniMp+ZJurmRDeOoRDe4URYN7u5/Zhcyv2q1gGzGku9nTo+zyWE+xeMcTOAYQ8=\n"
)

ROOT = hashlib.sha256(b"some ledger root").digest()


@pytest.fixture(scope="module")
def keys() -> dict[str, tuple[str, str]]:
    """Two fresh key pairs, plus a second key under the first key's name."""
    return {
        "log": generate_key("example.com/ledger"),
        "witness": generate_key("witness.example/w1"),
        "impostor": generate_key("example.com/ledger"),
    }


def cp_body(size: int = 7) -> str:
    return Checkpoint("example.com/ledger", size, ROOT).body()


# ---------------------------------------------------------------------------------------------------------------
# Interoperability: known answers from Go's note package and the C2SP spec


def test_go_known_answer_signature_byte_for_byte() -> None:
    assert sign(GO_TEXT, GO_SKEY) == GO_TEXT + "\n" + GO_PETER_SIG


def test_go_known_answer_keys() -> None:
    assert verifier_key(GO_SKEY) == GO_VKEY
    v = parse_verifier_key(GO_VKEY)
    assert (v.name, v.key_hash.hex()) == ("PeterNeumann", "c74f20a3")
    assert str(v) == GO_VKEY
    s = parse_signer_key(GO_SKEY)
    assert str(s) == GO_SKEY and "AYEK" not in repr(s)  # the repr hides the seed
    # The key hash formula of the spec, computed independently.
    public = base64.b64decode(GO_VKEY.split("+", 2)[2])
    assert hashlib.sha256(b"PeterNeumann\n" + public).digest()[:4] == bytes.fromhex("c74f20a3")
    assert key_hash("PeterNeumann", public[1:]).hex() == "c74f20a3"


def test_go_known_answer_open() -> None:
    note = GO_TEXT + "\n" + GO_PETER_SIG + GO_ENOCH_SIG
    assert verify_note(note, [GO_VKEY]) == ["PeterNeumann"]  # Enoch's signature: unknown key, ignored
    assert verify_note(note, [GO_VKEY, GO_ENOCH_VKEY]) == ["PeterNeumann", "EnochRoot"]
    assert verify_note(GO_TEXT + "\n" + GO_ENOCH_SIG, [GO_ENOCH_VKEY]) == ["EnochRoot"]
    # Go's duplicated-signature case: repeated valid lines are fine.
    assert verify_note(GO_TEXT + "\n" + GO_PETER_SIG * 2 + GO_ENOCH_SIG, [GO_VKEY]) == ["PeterNeumann"]


def test_go_known_answer_invalid_signature() -> None:
    # note_test.go TestOpen "Invalid signature": 4 base64 characters inserted into Peter's signature.
    bad = GO_PETER_SIG[:60] + "ABCD" + GO_PETER_SIG[60:]
    with pytest.raises(CheckFailed, match=r"invalid signature by key PeterNeumann\+c74f20a3"):
        verify_note(GO_TEXT + "\n" + bad, [GO_VKEY])


def test_go_known_answer_verifier_key_manglings_rejected() -> None:
    """Port of note_test.go TestNewVerifier/TestNewSigner: every substring and every one-character change fails."""
    parse_verifier_key(GO_VKEY)
    parse_signer_key(GO_SKEY)
    for key, parse in ((GO_VKEY, parse_verifier_key), (GO_SKEY, parse_signer_key)):
        variants = {key[i:j] for i in range(len(key) + 1) for j in range(i + 1, len(key) + 1)} - {key}
        variants |= {key[:i] + chr(ord(key[i]) + 1) + key[i + 1 :] for i in range(len(key))}
        for bad in sorted(variants):
            with pytest.raises(InputError):
                parse(bad)
    # From TestNewVerifier: wrong key length and unknown algorithm, each with a key hash adjusted to match.
    for bad in (
        "PeterNeumann+cc469956+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TWBADKEY==",
        "PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
    ):
        with pytest.raises(InputError):
            parse_verifier_key(bad)


def test_spec_checkpoint_example_parses() -> None:
    cp = Checkpoint.parse(SPEC_CHECKPOINT)
    assert cp.origin == "example.com/behind-the-sofa"
    assert cp.size == 20852163
    assert cp.root == base64.b64decode("CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=") and len(cp.root) == 32
    assert cp.body() == SPEC_CHECKPOINT.split("\n\n")[0] + "\n"
    assert Checkpoint.parse(cp.body()) == cp
    text, sigs = split_note(SPEC_CHECKPOINT)
    assert text == cp.body()
    assert [(s.name, len(s.key_hash), len(s.signature)) for s in sigs] == [("example.com/behind-the-sofa", 4, 64)]
    assert sigs[0].line() == SPEC_CHECKPOINT.split("\n\n")[1]


def test_no_trusted_key_is_check_failed(keys) -> None:
    with pytest.raises(CheckFailed, match="no trusted key") as info:
        verify_note(GO_TEXT + "\n" + GO_PETER_SIG + GO_ENOCH_SIG, [keys["log"][1]])
    assert "PeterNeumann+c74f20a3" in info.value.hint
    with pytest.raises(CheckFailed, match="no trusted key"):
        verify_note(SPEC_CHECKPOINT, [keys["log"][1]])


# ---------------------------------------------------------------------------------------------------------------
# Round trips and co-signing


def test_round_trip(keys) -> None:
    skey, vkey = keys["log"]
    assert skey.startswith("PRIVATE+KEY+example.com/ledger+") and vkey.startswith("example.com/ledger+")
    assert verifier_key(skey) == vkey
    cp = Checkpoint("example.com/ledger", 12345, ROOT)
    body = cp.body()
    assert body == f"example.com/ledger\n12345\n{base64.b64encode(ROOT).decode()}\n"
    note = sign(body, skey)
    # Format: body, one blank line, one signature line with EM DASH + space, base64 of 4 + 64 bytes.
    assert note.startswith(body + "\n\u2014 example.com/ledger ")
    assert note.encode("utf-8")[len(body) + 1 :].startswith(b"\xe2\x80\x94 ")
    assert note.endswith("\n") and note.count("\n") == 5
    raw = base64.b64decode(note.rstrip("\n").rsplit(" ", 1)[1], validate=True)
    assert len(raw) == 68 and raw[:4] == parse_verifier_key(vkey).key_hash
    assert sign(body, skey) == note  # Ed25519 is deterministic
    assert Checkpoint.parse(note) == cp
    assert verify_note(note, [vkey]) == ["example.com/ledger"]


def test_empty_tree_and_extension_lines(keys) -> None:
    skey, vkey = keys["log"]
    empty_root = hashlib.sha256(b"").digest()  # RFC 6962 root of the empty tree
    cp = Checkpoint("example.com/ledger", 0, empty_root)
    assert cp.body().split("\n")[1] == "0"
    assert Checkpoint.parse(sign(cp.body(), skey)) == cp
    ext = Checkpoint("example.com/ledger", 3, ROOT, ("ext one", "ext two"))
    note = sign(ext.body(), skey)
    assert Checkpoint.parse(note) == ext and Checkpoint.parse(note).body() == ext.body()
    assert verify_note(note, [vkey]) == ["example.com/ledger"]


def test_cosigning(keys) -> None:
    (log_s, log_v), (wit_s, wit_v) = keys["log"], keys["witness"]
    once = sign(cp_body(), log_s)
    twice = sign(once, wit_s)
    assert twice.startswith(once)  # the log's line is kept, the witness's appended
    assert len(split_note(twice)[1]) == 2
    assert verify_note(twice, [log_v, wit_v]) == ["example.com/ledger", "witness.example/w1"]
    assert verify_note(twice, [wit_v]) == ["witness.example/w1"]
    assert verify_note(twice, [log_v]) == ["example.com/ledger"]
    # Signing again with a key that already signed replaces its line instead of adding one.
    again = sign(twice, log_s)
    assert len(split_note(again)[1]) == 2
    assert split_note(again)[1][-1].name == "example.com/ledger"
    assert verify_note(again, [log_v, wit_v]) == ["witness.example/w1", "example.com/ledger"]
    assert Checkpoint.parse(again) == Checkpoint.parse(once)


def test_cosigned_note_with_one_bad_known_signature_is_rejected(keys) -> None:
    (log_s, log_v), (wit_s, wit_v) = keys["log"], keys["witness"]
    log_line = split_note(sign(cp_body(), log_s))[1][0].line()
    other = split_note(sign(cp_body(size=8), wit_s))[1][0].line()  # the witness signed another tree
    note = cp_body() + "\n" + log_line + other
    assert verify_note(note, [log_v]) == ["example.com/ledger"]  # witness unknown: ignored
    with pytest.raises(CheckFailed, match="invalid signature by key witness.example/w1"):
        verify_note(note, [log_v, wit_v])


# ---------------------------------------------------------------------------------------------------------------
# Verification failures


def test_flipped_character_in_body_fails(keys) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(), skey)
    tampered = note.replace("example.com/ledger\n", "example.com/ledgex\n", 1)
    assert tampered != note and Checkpoint.parse(tampered).origin == "example.com/ledgex"
    with pytest.raises(CheckFailed, match="invalid signature"):
        verify_note(tampered, [vkey])


def test_changed_size_fails(keys) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(size=7), skey)
    tampered = note.replace("\n7\n", "\n8\n", 1)
    assert Checkpoint.parse(tampered).size == 8
    with pytest.raises(CheckFailed, match="invalid signature"):
        verify_note(tampered, [vkey])


def test_changed_root_fails(keys) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(), skey)
    other = Checkpoint("example.com/ledger", 7, hashlib.sha256(b"other").digest()).body()
    tampered = other + note[len(cp_body()) :]
    with pytest.raises(CheckFailed, match="invalid signature"):
        verify_note(tampered, [vkey])


def test_same_name_other_key_is_ignored(keys) -> None:
    (log_s, log_v), (imp_s, _imp_v) = keys["log"], keys["impostor"]
    assert parse_verifier_key(log_v).key_hash != parse_signer_key(imp_s).key_hash
    forged = sign(cp_body(), imp_s)
    with pytest.raises(CheckFailed, match="no trusted key"):
        verify_note(forged, [log_v])
    # Ignored, not fatal: next to a genuine signature it does not matter.
    both = sign(forged, log_s)
    assert verify_note(both, [log_v]) == ["example.com/ledger"]


def test_signature_hash_mismatch_under_right_name_is_ignored(keys) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(), skey)
    text, (sig,) = split_note(note)
    wrong_hash = bytes([sig.key_hash[0] ^ 1]) + sig.key_hash[1:]
    relabeled = text + "\n" + type(sig)(sig.name, wrong_hash, sig.signature).line()
    with pytest.raises(CheckFailed, match="no trusted key"):
        verify_note(relabeled, [vkey])


def test_truncated_signature_fails(keys) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(), skey)
    assert note.endswith("=\n")
    # Four base64 characters less: still well-formed, but a 62-byte signature from a known key.
    with pytest.raises(CheckFailed, match="invalid signature"):
        verify_note(note[:-5] + "\n", [vkey])
    # One character less: not base64 any more.
    with pytest.raises(InputError, match="base64"):
        verify_note(note[:-2] + "\n", [vkey])
    # Only the key hash left.
    text, (sig,) = split_note(note)
    with pytest.raises(InputError, match="too short"):
        verify_note(text + "\n\u2014 example.com/ledger " + base64.b64encode(sig.key_hash).decode() + "\n", [vkey])


# ---------------------------------------------------------------------------------------------------------------
# Malformed notes and checkpoints


GOOD_ROOT64 = base64.b64encode(ROOT).decode()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (f"example.com/ledger\n7\n{GOOD_ROOT64}", "newline"),
        (f"example.com/ledger\n01\n{GOOD_ROOT64}\n", "canonical decimal"),
        (f"example.com/ledger\n00\n{GOOD_ROOT64}\n", "canonical decimal"),
        (f"example.com/ledger\n-1\n{GOOD_ROOT64}\n", "canonical decimal"),
        (f"example.com/ledger\n+1\n{GOOD_ROOT64}\n", "canonical decimal"),
        (f"example.com/ledger\n 1\n{GOOD_ROOT64}\n", "canonical decimal"),
        (f"example.com/ledger\n1_000\n{GOOD_ROOT64}\n", "canonical decimal"),
        (f"example.com/ledger\n\u0661\n{GOOD_ROOT64}\n", "canonical decimal"),  # Arabic-Indic digit one
        (f"example.com/ledger\n{2**64}\n{GOOD_ROOT64}\n", "tree size"),
        (f"example.com/ledger\n7\n{base64.b64encode(ROOT[:31]).decode()}\n", "31 bytes"),
        (f"example.com/ledger\n7\n{base64.b64encode(ROOT + b'x').decode()}\n", "33 bytes"),
        (f"example.com/ledger\n7\n{GOOD_ROOT64.rstrip('=')}\n", "base64"),
        # 'B' sets one of the two unused low bits of the last character: decodes, but is not canonical.
        (f"example.com/ledger\n7\n{GOOD_ROOT64[:-2] + 'B='}\n", "non-canonical base64"),
        (f"example.com/ledger\n7\n{GOOD_ROOT64.replace('=', '')}!=\n", "base64"),
        (f"\n7\n{GOOD_ROOT64}\n", "empty line"),
        ("example.com/ledger\n7\n", "at least 3"),
        (f"example.com/ledger\n7\n{GOOD_ROOT64}\n\n", "empty line"),
        (f"example.com/ledger\n7\n{GOOD_ROOT64}\n\nextra\n", "empty line"),
        (f"example.com/ledger\r\n7\n{GOOD_ROOT64}\n", "control character"),
        (f"example.com/led\x00ger\n7\n{GOOD_ROOT64}\n", "control character"),
        (f"example.com/ledger\n7\n{GOOD_ROOT64}\n\u2014 example.com/ledger AAAA\n", "signature line directly after"),
    ],
)
def test_malformed_checkpoint_rejected(text: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        Checkpoint.parse(text)


def test_parse_accepts_well_formed_variants_of_the_above() -> None:
    """Controls for the rejections above: the same texts, corrected, parse."""
    assert Checkpoint.parse(f"example.com/ledger\n7\n{GOOD_ROOT64}\n").size == 7
    assert Checkpoint.parse(f"example.com/ledger\n10\n{GOOD_ROOT64}\n").size == 10
    assert Checkpoint.parse(f"example.com/ledger\n{2**64 - 1}\n{GOOD_ROOT64}\n").size == 2**64 - 1
    assert Checkpoint.parse(f"origin with spaces\n0\n{GOOD_ROOT64}\n").origin == "origin with spaces"


def test_checkpoint_constructor_validates() -> None:
    for bad in (
        dict(origin="", size=1, root=ROOT),
        dict(origin="a\nb", size=1, root=ROOT),
        dict(origin="o", size=-1, root=ROOT),
        dict(origin="o", size=True, root=ROOT),
        dict(origin="o", size=2**64, root=ROOT),
        dict(origin="o", size=1, root=ROOT[:31]),
        dict(origin="o", size=1, root=ROOT.hex()),
        dict(origin="o", size=1, root=ROOT, extensions=("",)),
    ):
        with pytest.raises(InputError):
            Checkpoint(**bad)


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda n: n.replace("\n\n", "\n", 1), "no blank line"),  # missing blank line
        (lambda n: n[:-1], "newline"),  # no final newline
        (lambda n: n + "\n", "no signature lines"),  # trailing empty line: the last blank line ends the note
        (lambda n: n.replace("\u2014 ", "-- ", 1), "does not start with an em dash"),
        (lambda n: n.replace("\u2014 ", "\u2013 ", 1), "does not start with an em dash"),  # EN DASH
        (lambda n: n.replace("\u2014 ", "\u2014", 1), "does not start with an em dash"),
        (lambda n: n + "Unexpected line.\n", "does not start with an em dash"),
        (lambda n: n.replace("\u2014 example.com/ledger ", "\u2014 example com/ledger ", 1), "base64"),
        (lambda n: n.replace("\u2014 example.com/ledger ", "\u2014 example+com/ledger ", 1), "key name"),
        (lambda n: n.replace("\u2014 example.com/ledger ", "\u2014  ", 1), "key name"),
        (lambda n: n.replace("=\n", "=\r\n"), "control character"),
        (lambda n: "\x01" + n, "control character"),
        (lambda n: n.rsplit("\n\n", 1)[0] + "\n\n", "no signature lines"),
        (lambda n: n + n.split("\n\n")[1] * 100, "at most 100"),
    ],
)
def test_malformed_note_rejected(keys, mangle, match: str) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(), skey)
    assert verify_note(note, [vkey]) == ["example.com/ledger"]  # the unmangled control verifies
    with pytest.raises(InputError, match=match):
        verify_note(mangle(note), [vkey])


def test_sign_rejects_bad_text(keys) -> None:
    skey, _ = keys["log"]
    with pytest.raises(InputError, match="newline"):
        sign(cp_body()[:-1], skey)
    with pytest.raises(InputError, match="control character"):
        sign("a\tb\n", skey)
    with pytest.raises(InputError, match="em dash"):  # looks signed, but the block is broken
        sign(cp_body() + "\n\u2014 example.com/ledger " + "A" * 92 + "\nnot a signature\n", skey)


# ---------------------------------------------------------------------------------------------------------------
# Keys


def test_key_strings_rejected(keys) -> None:
    skey, vkey = keys["log"]
    name, hexhash, b64 = vkey.split("+", 2)
    other_hash = f"{int(hexhash, 16) ^ 1:08x}"
    bad_vkeys = {
        skey: "signer",
        f"{name}+{other_hash}+{b64}": "key hash does not match",
        f"{name}+{hexhash[:7]}+{b64}": "8 hex",
        f"{name}+{hexhash}0+{b64}": "8 hex",
        f"{name}+0x{hexhash[2:]}+{b64}": "8 hex",
        f"{name}+{hexhash}": "malformed",
        f"+{hexhash}+{b64}": "key name",
        f"a b+{hexhash}+{b64}": "key name",
        f"{name}+{hexhash}+{b64[:-1]}": "base64",
        f"{name}+{hexhash}+" + base64.b64encode(b"\x02" + base64.b64decode(b64)[1:]).decode(): "unknown algorithm",
        f"{name}+{hexhash}+" + base64.b64encode(base64.b64decode(b64)[:32]).decode(): "31 bytes",
        f"{name}+{hexhash}+": "no key data",
        "": "malformed",
    }
    for bad, match in bad_vkeys.items():
        with pytest.raises(InputError, match=match):
            parse_verifier_key(bad)
    _, _, sname, shash, sb64 = skey.split("+", 4)
    bad_skeys = {
        vkey: "PRIVATE\\+KEY",
        skey.replace("PRIVATE+KEY+", "private+key+"): "PRIVATE\\+KEY",
        skey.replace("PRIVATE+KEY+", "PRIVATE+KEYS+"): "PRIVATE\\+KEY",
        skey.replace("PRIVATE+KEY+", "PRIVATE+KEY++"): "key name",
        f"PRIVATE+KEY+{sname}+{other_hash}+{sb64}": "key hash does not match",
        f"PRIVATE+KEY+{sname}+{shash}+{sb64[:-2]}": "base64",
    }
    for bad, match in bad_skeys.items():
        with pytest.raises(InputError, match=match):
            parse_signer_key(bad)
    with pytest.raises(InputError, match="PRIVATE"):
        sign(cp_body(), vkey)  # a verifier key cannot sign
    with pytest.raises(InputError, match="signer"):
        verify_note(sign(cp_body(), skey), [skey])  # nor can a signer key verify


@pytest.mark.parametrize("name", ["", "a b", "a+b", "a\tb", "a\u00a0b", "tab\n"])
def test_generate_key_rejects_bad_names(name: str) -> None:
    with pytest.raises(InputError, match="key name"):
        generate_key(name)


def test_verify_note_needs_keys(keys) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(), skey)
    with pytest.raises(InputError, match="no verifier key"):
        verify_note(note, [])
    with pytest.raises(InputError, match="list"):
        verify_note(note, vkey)  # type: ignore[arg-type]
    assert verify_note(note, [vkey, vkey]) == ["example.com/ledger"]  # the same key twice is harmless


# ---------------------------------------------------------------------------------------------------------------
# Files


def test_write_and_read_checkpoint(tmp_path, keys) -> None:
    skey, vkey = keys["log"]
    note = sign(cp_body(), skey)
    path = tmp_path / "sub" / "checkpoint"
    write_checkpoint(path, note)
    assert path.read_bytes() == note.encode("utf-8")
    assert read_checkpoint(path) == note
    assert verify_note(read_checkpoint(path), [vkey]) == ["example.com/ledger"]
    write_checkpoint(path, cp_body(size=9))  # unsigned, replacing the old file
    assert Checkpoint.parse(read_checkpoint(path)).size == 9
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint"]  # no temporary file left behind


def test_read_and_write_checkpoint_refuse_bad_files(tmp_path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        read_checkpoint(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.write_bytes(b"example.com/ledger\n01\n" + GOOD_ROOT64.encode() + b"\n")
    with pytest.raises(InputError, match="bad: .*canonical decimal"):
        read_checkpoint(bad)
    bad.write_bytes(b"\xff\xfe\n")
    with pytest.raises(InputError, match="UTF-8"):
        read_checkpoint(bad)
    target = tmp_path / "never"
    with pytest.raises(InputError):
        write_checkpoint(target, "not a checkpoint\n")
    assert not target.exists()


def test_load_key(tmp_path, keys) -> None:
    skey, vkey = keys["log"]
    key_file = tmp_path / "log.key"
    key_file.write_text(skey + "\n")
    assert load_key(key_file) == skey
    assert load_key(str(key_file)) == skey
    assert load_key(vkey) == vkey  # not a file: the string itself
    assert load_key(GO_SKEY) == GO_SKEY  # contains '/' and '+', still not a path
    (tmp_path / "empty.key").write_text(" \n")
    with pytest.raises(InputError, match="empty"):
        load_key(tmp_path / "empty.key")
    with pytest.raises(InputError, match="empty"):
        load_key("")


# ---------------------------------------------------------------------------------------------------------------
# Imports


def test_unsigned_checkpoints_need_neither_cryptography_nor_torch(tmp_path) -> None:
    """The module imports neither package; unsigned checkpoints work with `cryptography` unimportable."""
    code = f"""
import sys
sys.modules["cryptography"] = None  # makes `import cryptography...` fail
from kvgraft_cli.ledger import checkpoint as c
from kvgraft_cli.errors import InputError
assert "torch" not in sys.modules, "checkpoint imported torch"
cp = c.Checkpoint("example.com/ledger", 3, bytes(32))
c.write_checkpoint({str(tmp_path / "cp")!r}, cp.body())
assert c.Checkpoint.parse(c.read_checkpoint({str(tmp_path / "cp")!r})) == cp
assert c.parse_verifier_key({GO_VKEY!r}).name == "PeterNeumann"
try:
    c.generate_key("example.com/ledger")
except InputError as e:
    assert "cryptography" in e.message and "pip install" in e.hint
else:
    raise AssertionError("generate_key worked without cryptography")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
