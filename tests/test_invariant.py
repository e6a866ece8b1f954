"""The invariant prefill schedule (issue #13): a graft is byte-identical to one forward over the whole prompt, and
any chunking of the prefix deposits the same artifact. Under the `single` schedule neither holds on this machine
(the batched kernels' rows depend on how many rows they compute together), which is what makes these tests able to
fail: each byte comparison below is also made under `single` and must differ there."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import EXAMPLES, run_cli

from kvgraft_cli.artifacts import format as kvg
from kvgraft_cli.config.manifest import compute_pin, load_manifest, with_overrides
from kvgraft_cli.engine.engine import tensor_sha256
from kvgraft_cli.runs import matrix as mx
from kvgraft_cli.util.hashing import sha256_bytes


def _with_schedule(engine, schedule: str, chunk_size=None):
    m = with_overrides(engine.manifest, {"prefill.schedule": schedule, "prefill.chunk_size": chunk_size})
    return dataclasses.replace(engine, manifest=m)


@pytest.fixture(scope="module")
def prompt(engine):
    prefix = engine.prefix_ids("Problem: add the first ten odd numbers.\nSolution: 1+3+5+...+19 = 100.\n")
    suffix = engine.encode("\nQuestion: and the first twenty?\nAnswer:")
    return prefix, suffix


def _deposit_sha(eng, prefix) -> str:
    cache, last = eng.prefill(prefix)
    return sha256_bytes(kvg.encode(prefix, eng.capture(cache), eng.artifact_meta(tensor_sha256(last))))


def _graft_logits(eng, prefix, suffix):
    cache, _ = eng.prefill(prefix)
    grafted = eng.restore(kvg.decode(kvg.encode(prefix, eng.capture(cache), eng.artifact_meta("0" * 64))).layers)
    return eng.forward(grafted, suffix)


def test_graft_equals_one_forward_over_the_whole_prompt(engine, prompt):
    prefix, suffix = prompt
    inv = _with_schedule(engine, "invariant")
    one = inv.single_pass(prefix + suffix, len(suffix))
    assert tensor_sha256(one) == tensor_sha256(_graft_logits(inv, prefix, suffix))
    # The same comparison under `single` differs: one batched call is not prefill-then-suffix.
    single = _with_schedule(engine, "single")
    assert tensor_sha256(single.single_pass(prefix + suffix, len(suffix))) != tensor_sha256(
        _graft_logits(single, prefix, suffix)
    )
    # The invariant bits are their own: not those of the model's batched kernels (reported, not promised).
    assert tensor_sha256(inv.batched_pass(prefix + suffix, len(suffix))) != tensor_sha256(one)


def test_any_chunking_deposits_the_same_artifact(engine, prompt):
    prefix, _ = prompt
    shas = {_deposit_sha(_with_schedule(engine, "invariant", size), prefix) for size in (None, 1, 7, 64)}
    assert len(shas) == 1
    chunked = {_deposit_sha(_with_schedule(engine, s, size), prefix) for s, size in (("single", None), ("chunked", 7))}
    assert len(chunked) == 2  # without the invariant schedule, chunking changes the cache bits


def test_the_compute_pin_leaves_out_how_invariant_calls_are_grouped():
    base = load_manifest(None)
    pins = {
        json.dumps(
            compute_pin(with_overrides(base, {"prefill.schedule": "invariant", "prefill.chunk_size": c}).data),
            sort_keys=True,
        )
        for c in (None, 7, 512)
    }
    assert len(pins) == 1
    other = with_overrides(base, {"prefill.schedule": "chunked", "prefill.chunk_size": 7})
    assert compute_pin(other.data)["prefill"] == {"schedule": "chunked", "chunk_size": 7}
    assert compute_pin(base.data)["prefill"] == {"schedule": "single", "chunk_size": None}  # pins unchanged


def test_matrix_single_pass_is_exact_only_under_invariant(tmp_path):
    inv = mx.run_profile(
        "portable", tmp_path, ["llama", "gemma3"], ["float32"], 3, schedule="invariant", single_pass=True
    )
    assert all(c.exact and c.sha_equal == 3 and c.schedule == "invariant" for c in inv), inv
    single = mx.run_profile("portable", tmp_path, ["llama", "gemma3"], ["float32"], 3, single_pass=True)
    assert all(not c.exact for c in single), single


def _manifest(tmp_path, name: str, chunk_size) -> str:
    text = run_cli(
        "manifest", "init", "builtin:tiny-gemma4", "--schedule", "invariant", cwd=tmp_path, check_rc=0
    ).stdout
    if chunk_size is not None:
        text = text.replace("chunk_size: null", f"chunk_size: {chunk_size}")
    (tmp_path / name).write_text(text, encoding="utf-8")
    return name


def test_cli_deposit_in_chunks_grafts_into_another_chunking(tmp_path):
    """Deposit with chunks of 7 tokens, then `graft --check` under a manifest that prefills in one call: the
    compute pins agree, the fresh side reproduces the deposit, and the single forward is SHA-equal."""
    a, b = _manifest(tmp_path, "a.yaml", 7), _manifest(tmp_path, "b.yaml", None)
    dep = json.loads(
        run_cli("deposit", str(EXAMPLES), "-m", a, "--limit", "1", "--json", cwd=tmp_path, check_rc=0).stdout
    )
    sha = dep["results"][0]["artifact"]
    check = json.loads(
        run_cli("graft", sha, "--check", "--samples", "2", "-m", b, "--json", cwd=tmp_path, check_rc=0).stdout
    )
    assert check["passed"] and check["deposit_reproduced"] and check["sha_equal"] == 2
    assert check["single_pass_sha_equal"] and check["single_pass_max_abs_diff"] == 0.0
    assert check["batched_max_abs_diff"] > 0  # the batched kernels' bits are other bits
    assert check["schedule"]["schedule"] == "invariant"
