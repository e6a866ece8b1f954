"""RFC 8785 canonical JSON: every pair in tests/vectors/jcs, and the ledger's fast path agrees with it."""

from __future__ import annotations

import json

import pytest
from conftest import VECTORS

from kvgraft_cli.audit.verify import canonical_line
from kvgraft_cli.util.hashing import canonical_json

JCS = VECTORS / "jcs"
NAMES = sorted(p.stem for p in (JCS / "input").glob("*.json"))


def test_all_vectors_present():
    assert NAMES == ["arrays", "french", "structures", "unicode", "values", "weird"]


@pytest.mark.parametrize("name", NAMES)
def test_jcs_vector(name):
    value = json.loads((JCS / "input" / f"{name}.json").read_bytes())
    want = (JCS / "output" / f"{name}.json").read_bytes()
    assert canonical_json(value) == want
    assert canonical_json(value).hex() == "".join((JCS / "outhex" / f"{name}.txt").read_text().split())


INSIDE = ["arrays", "unicode"]  # vectors without floats and with ASCII keys: the ledger's value space


@pytest.mark.parametrize("name", INSIDE)
def test_ledger_fast_path_equals_jcs_inside_the_value_space(name):
    value = json.loads((JCS / "input" / f"{name}.json").read_bytes())
    assert canonical_line(value) == canonical_json(value)


@pytest.mark.parametrize("name", sorted(set(NAMES) - set(INSIDE)))
def test_vectors_outside_the_value_space_are_flagged(name):
    from kvgraft_cli.audit.verify import _value_problem

    assert _value_problem(json.loads((JCS / "input" / f"{name}.json").read_bytes())) is not None


def test_fast_path_equals_jcs_on_random_values():
    """Random nested values in the value space (ints of any size, control, non-BMP and non-ASCII characters)."""
    import random

    rng = random.Random(8785)
    alphabet = [chr(c) for c in (0, 1, 8, 9, 10, 12, 13, 31, 34, 39, 47, 92, 127, 128, 0x2028, 0xE000, 0xFFFF)]
    alphabet += ["a", "Z", "é", "€", "😀", "\U0001f600", " "]

    def text(k):
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, k)))

    def value(depth):
        r = rng.random()
        if depth > 3 or r < 0.4:
            return rng.choice([None, True, False, rng.randint(-(2**53 - 1), 2**53 - 1), rng.randint(-9, 9), text(8)])
        if r < 0.7:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        keys = ["".join(rng.choice("abcXYZ_ -~!") for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 5))]
        return {k: value(depth + 1) for k in keys}

    for _ in range(2000):
        v = value(0)
        assert canonical_line(v) == canonical_json(v), v


def test_integers_beyond_ijson_are_outside_the_value_space():
    from kvgraft_cli.audit.verify import _value_problem

    assert _value_problem({"n": 2**53 - 1}) is None
    assert "2**53" in _value_problem({"n": [2**53]})


def test_prompt_keys_written_directly_are_the_canonical_json_ones():
    """store.local.prompt_key writes its RFC 8785 bytes directly for hex values: the same key as the general
    serializer's for a first chunk (no parent) and a later one, and anything not hex still goes through it."""
    import hashlib
    import secrets

    from kvgraft_cli.store.local import prompt_key
    from kvgraft_cli.util.hashing import sha256_json

    for parent in (None, secrets.token_hex(32)):
        m, t = secrets.token_hex(32), secrets.token_hex(32)
        want = {"manifest_sha256": m, "prompt_parent_sha256": parent, "token_ids_sha256": t}
        assert prompt_key(m, parent, t) == sha256_json(want)
        assert prompt_key(m, parent, t) == hashlib.sha256(canonical_json(want)).hexdigest()
    odd = 'not "hex"\n'
    assert prompt_key(odd, None, odd) == sha256_json(
        {"manifest_sha256": odd, "prompt_parent_sha256": None, "token_ids_sha256": odd}
    )
