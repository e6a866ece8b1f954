"""Where does a schedule change the bits? Compare, module by module, one forward over prefix + suffix with the
manifest's schedule (prefill the prefix, then the suffix on that cache), and name the first module whose output
rows for the suffix differ (issue #13's diagnostic: which op breaks schedule invariance).

Every module of the model gets a forward hook; each records its output (the first tensor of a tuple) for the
suffix's rows: the last len(suffix) rows of the single pass, all rows of the suffix forward in the two-step run
(modules whose output has no sequence dimension of that size are compared whole). Hooks fire in execution order,
so the first entry that is not byte-identical (torch.equal) names the first module whose result depends on how many
rows it computed together; later differences may only inherit it. Functional ops inside a module (attention's
q @ k^T, softmax, the weighted sum) show up as that module's output.

    python scripts/schedule_diff.py [-m MANIFEST] [--prefix-tokens 300] [--suffix-tokens 121] [--all]

Under the manifest's kernel flags (the embedded default: the portable profile), pinned before torch is imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--manifest", type=Path, default=None, help="run-manifest (default: the embedded one)")
    ap.add_argument("--prefix-tokens", type=int, default=179)
    ap.add_argument("--suffix-tokens", type=int, default=121)
    ap.add_argument("--all", action="store_true", help="list every module that differs, not only the first")
    args = ap.parse_args()

    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine.engine import load_engine

    eng = load_engine(load_manifest(args.manifest))  # pins the manifest's kernel flags before torch loads
    import torch

    gen = torch.Generator().manual_seed(0)
    vocab = min(eng.model.config.vocab_size, 256)
    ids = torch.randint(3, vocab, (args.prefix_tokens + args.suffix_tokens,), generator=gen).tolist()
    prefix, suffix = ids[: args.prefix_tokens], ids[args.prefix_tokens :]
    n = len(suffix)

    records: list[tuple[str, object]] = []
    active = [False]

    def hook(name):
        def record(_module, _inputs, output):
            if not active[0]:
                return
            t = output[0] if isinstance(output, (tuple, list)) else output
            if not torch.is_tensor(t):
                return
            records.append((name, t.detach().clone()))

        return record

    handles = [m.register_forward_hook(hook(name or "model")) for name, m in eng.model.named_modules()]
    try:
        active[0] = True
        records.clear()
        single_logits = eng.forward(eng.new_cache(), ids)[-n:]
        single = list(records)
        active[0] = False
        cache, _ = eng.prefill(prefix)
        active[0] = True
        records.clear()
        two_step_logits = eng.forward(cache, suffix)
        two_step = list(records)
    finally:
        for h in handles:
            h.remove()

    print(
        f"{eng.manifest.source}: single forward over {len(ids)} tokens vs prefill({len(prefix)}) + forward({n}) "
        f"by the manifest's schedule ({eng.manifest.prefill.as_written()})"
    )
    if [a for a, _ in single] != [b for b, _ in two_step]:
        print("the two runs called different modules; comparing by position anyway")
    first = None
    for (name, a), (_, b) in zip(single, two_step):
        a = suffix_rows(a, b, len(ids), n)
        if a.shape != b.shape:
            print(f"  {name}: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        if torch.equal(a, b):
            continue
        diff = (a.double() - b.double()).abs().max().item()
        if first is None:
            first = name
            print(f"FIRST DIFFERENCE: {name}  max |diff| {diff:.3e}  shape {tuple(a.shape)}")
            if not args.all:
                break
        else:
            print(f"  also differs: {name}  max |diff| {diff:.3e}")
    if first is None:
        print(f"no module differs: {len(single)} module outputs byte-identical")
    same = torch.equal(single_logits, two_step_logits)
    diff = (single_logits.double() - two_step_logits.double()).abs().max().item()
    print(f"suffix logits: {'byte-identical' if same else f'max |diff| {diff:.3e}'}")


def suffix_rows(a, b, total: int, n: int):
    """The single pass's output narrowed to the suffix's rows: along the first axis (after the batch) that holds
    ``total`` positions here and ``n`` in the two-step run ([batch, seq, hidden], [batch, seq, heads, dim],
    [batch, heads, seq, dim] alike); unchanged when there is none (a cos/sin table, a whole-model output)."""
    if a.dim() == b.dim():
        for d in range(1, a.dim()):
            if a.shape[d] == total and b.shape[d] == n and a.shape[:d] == b.shape[:d]:
                return a.narrow(d, total - n, n)
    return a


if __name__ == "__main__":
    main()
