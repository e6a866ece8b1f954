"""Graft versus fresh computation: byte-exact under the manifest's schedule, and a check that can fail."""

from __future__ import annotations

import dataclasses

import pytest

from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.runs.graft import check_suffixes, graft_check, graft_generate


def test_graft_check_is_exact(deposited, engine):
    ctx, report = deposited
    rep = graft_check(ctx, engine, "angle-1", samples=6, max_new_tokens=4)
    assert rep.passed, rep.summary()
    assert rep.sha_equal == 6 and rep.max_kl == 0.0 and rep.argmax_agreement == 1.0
    assert rep.deposit_reproduced and rep.logits_reproduced
    assert all(s.fresh_sha256 == s.graft_sha256 for s in rep.samples)
    # The suffixes differ from each other, so the samples are not one case repeated.
    assert len({s.fresh_sha256 for s in rep.samples}) == 6
    # Informative, never hidden: one forward over prefix+suffix is not bit-identical to the two-step schedule.
    assert rep.single_pass_max_abs_diff > 0
    last = ledger.read(ctx.ledger)[-1]
    assert last["kind"] == "graft-check" and last["outputs"]["result"]["sha_equal"] == 6


def test_graft_equals_fresh_bytes_directly(deposited, engine):
    """The same comparison written out with torch.equal, independent of graft_check's bookkeeping."""
    import torch

    from kvgraft_cli.store.local import Store

    ctx, _ = deposited
    with Store(ctx.store) as s:
        _, art = s.load(s.resolve("gcd-1"))
    suffix = engine.encode("\nQuestion: why?\nAnswer:")
    fresh, _ = engine.prefill(art.token_ids)
    grafted = engine.restore(art.layers)
    assert torch.equal(engine.forward(fresh, suffix), engine.forward(grafted, suffix))


def test_check_fails_when_restore_loses_sliding_state(deposited, engine, monkeypatch):
    """Break the restore (forget the sliding layers' cumulative length): the check must go red."""
    ctx, _ = deposited
    real_restore = engine.restore

    def broken_restore(layers, grow=True):
        cache = real_restore(layers, grow)
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = layer.keys.shape[-2]
        return cache

    monkeypatch.setattr(engine, "restore", broken_restore)
    rep = graft_check(ctx, engine, "angle-1", samples=3, max_new_tokens=2)
    assert not rep.passed
    assert rep.sha_equal < 3


def test_check_fails_when_a_kv_value_is_perturbed(deposited, engine, monkeypatch):
    """A tiny change to one cached value (last position, one element) is caught."""
    ctx, _ = deposited
    real_restore = engine.restore

    def nudged(layers, grow=True):
        cache = real_restore(layers, grow)
        v = cache.layers[3].values
        v[0, 0, -1, 0] += 1e-4
        return cache

    monkeypatch.setattr(engine, "restore", nudged)
    rep = graft_check(ctx, engine, "angle-1", samples=2, max_new_tokens=1)
    assert rep.sha_equal == 0 and not rep.passed


def test_suffixes_are_deterministic_and_distinct():
    a, b = check_suffixes(0, 50), check_suffixes(0, 50)
    assert a == b and len(set(a)) == 50
    assert check_suffixes(1, 5) != check_suffixes(0, 5)


def test_graft_generate_continues_and_is_logged(deposited, engine):
    ctx, _ = deposited
    r = graft_generate(ctx, engine, "sum-1", "What is 17+25?", 5)
    assert 1 <= len(r.generated_ids) <= 5
    entry = ledger.read(ctx.ledger)[-1]
    assert entry["kind"] == "graft" and entry["inputs"]["artifact"]["sha256"] == r.artifact
    assert entry["outputs"]["generated_ids"]["ids"] == r.generated_ids


@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_schedule_is_exact_and_differs_from_single(tmp_path, engine, chunk):
    """A graft is exact with respect to its own schedule; chunking changes the bits (so it must be pinned)."""
    import torch

    from kvgraft_cli.config.manifest import with_overrides

    ids = engine.prefix_ids("Problem: compute 12*12.\nSolution: 12*12 = \\boxed{144}.\n" * 2)
    chunked = with_overrides(engine.manifest, {"prefill.schedule": "chunked", "prefill.chunk_size": chunk})
    eng = dataclasses.replace(engine, manifest=chunked)  # a new Engine: its prompts are bound anew
    cache, _ = eng.prefill(ids)
    restored = eng.restore(eng.capture(cache))
    suffix = eng.encode("\nQuestion: and 13*13?\nAnswer:")
    fresh, _ = eng.prefill(ids)
    assert torch.equal(eng.forward(fresh, suffix), eng.forward(restored, suffix))
    assert chunked.compute_sha256 != engine.manifest.compute_sha256


def test_check_decodes_its_own_budget_not_the_manifests(tmp_path, deposited, engine):
    """`graft --check` under a manifest whose answer budget is large decodes CHECK_MAX_NEW_TOKENS per sample (the
    fresh logits hash is that of a 16-step check, computed here in-process) and records 16; -n overrides it; a plain
    `graft` still decodes the manifest's budget."""
    import json
    import shutil

    from conftest import run_cli

    from kvgraft_cli.config.manifest import data_dir
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.graft import CHECK_MAX_NEW_TOKENS

    assert CHECK_MAX_NEW_TOKENS == 16
    import inspect

    from kvgraft_cli.cli.graft import graft as command

    params = inspect.signature(command).parameters  # the help says the number (cli/graft.py does not import it)
    assert f"{CHECK_MAX_NEW_TOKENS} per sample" in params["max_new_tokens"].default.help
    assert f"{CHECK_MAX_NEW_TOKENS} decode steps per sample" in params["check"].default.help
    text = (data_dir() / "default.yaml").read_text()
    assert "  max_new_tokens: 16\n" in text
    (tmp_path / "big.yaml").write_text(text.replace("  max_new_tokens: 16\n", "  max_new_tokens: 64\n"))
    shutil.copytree(deposited[0].store, tmp_path / "store")
    opts = ("-m", "big.yaml", "--store", "store", "--ledger", "l.jsonl", "--json")

    def check(*n: str) -> tuple[dict, dict]:
        p = run_cli("graft", "gcd-1", "--check", "--samples", "1", *n, *opts, cwd=tmp_path, check_rc=0)
        return json.loads(p.stdout), ledger.read(tmp_path / "l.jsonl")[-1]

    ctx = RunContext.make(engine.manifest, tmp_path / "store", tmp_path / "here.jsonl")
    for n, cli in ((16, ()), (3, ("-n", "3"))):
        got, entry = check(*cli)
        want = graft_check(ctx, engine, "gcd-1", 1, n).fresh_logits_sha256
        assert entry["kind"] == "graft-check" and entry["inputs"]["max_new_tokens"] == n, cli
        assert got["fresh_logits_sha256"] == entry["outputs"]["fresh_logits"]["sha256"] == want, cli
        assert got["passed"]
    # A replay re-runs a check with the number its entry records (a prereg made from this ledger carries it into
    # replay's graft_check call), so it reproduces these hashes; an entry from before the check's default recorded the
    # manifest's budget it ran, and replays with that.
    from kvgraft_cli.runs.replay import prereg_from_ledger

    pr = prereg_from_ledger(tmp_path / "l.jsonl", "t", tmp_path / "p.yaml")
    assert [(r["kind"], r["max_new_tokens"]) for r in pr["runs"]] == [("graft-check", 16), ("graft-check", 3)]
    p = run_cli("graft", "gcd-1", *opts, cwd=tmp_path, check_rc=0)
    ids = json.loads(p.stdout)["generated_ids"]
    assert (
        len(ids) > CHECK_MAX_NEW_TOKENS
        and ids == graft_generate(ctx, engine, "gcd-1", "What is the final answer?", 64).generated_ids
    )
