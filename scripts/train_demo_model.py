"""Train the demo model: a tiny Gemma-4 that really reads its context (kvgraft_cli/data/demo-gemma4).

The embedded random model cannot copy anything from a grafted cache, so no figure about the library can come from
it. This script trains, deterministically and on synthetic data only, a 0.65M-parameter Gemma-4 text model (the
embedded model's byte-level tokenizer; hidden 128, 4 layers alternating sliding-window (64) and full attention,
4 heads, 2 KV heads) on exactly the text `kvgraft solve` shows a model:

    <bos>Problem: P1\\nSolution: S1 The answer is: A1\\n ... \\nQuestion: Q\\nAnswer: A\\n

Two skills, nothing else:
- recurring: Q is the problem of one grafted block (one block, or two with one that matches): copy that block's
  answer;
- transfer: the blocks are solved instances of a synthetic *family* ("<fam> code of item <i>?", where every item of a
  family shares one random code that only the examples reveal) and Q is a new instance: copy the family's code.

The loss is on the answer tokens only; contexts grow from short to long over the run (curriculum). Problems, words,
answers and families are random strings from seeded generators: no MATH-500 text, and never a problem or answer the
README evaluates on (those come from other seeds, see write_demo_files). It is a synthetic demonstration of the
mechanism, not a capable model: it knows no mathematics, and without a library it can only guess.

    python scripts/train_demo_model.py                     # the committed model (see below; ~45 min here)
    python scripts/train_demo_model.py --steps 3 --out DIR # a smoke run (tests)
    python scripts/train_demo_model.py --demo-files DIR    # the demo's library.jsonl and queries.jsonl
    python scripts/train_demo_model.py --eval DIR          # held-out accuracy with and without the blocks

Measured (one thread, other work sharing the 2-core machine): copying appeared between steps 500 and 1,000. Held-out
probes of 40 samples at short / current context lengths: step 500 2.5% / 0%, step 1,000 22.5% / 37.5%, step 1,500
60% / 55%, step 2,000 85% / 75%. The committed model is step 2,000 of the 2,500-step curriculum (2,560 s). Through
`kvgraft solve` it answers 49/50 of the demo queries from the library and 0/50 without (docs/LIBRARY.md, "The flywheel,
measured"). An earlier recipe (1.2M parameters, mixed question/answer losses, contexts growing to 2,000 tokens)
never copied more than 4% in its probe logs over 3,850 steps: short contexts, batches of 16 and an answer-only loss made the difference.
The committed weights came from a run of this recipe whose batches and config were checked identical to this
script's; the full 2,000 steps were not re-run to compare the bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "kvgraft_cli" / "data" / "demo-gemma4"
TRAIN_SEED, EVAL_SEED, DEMO_SEED = 0, 123, 2026
LOW = "abcdefghijklmnopqrstuvwxyz"
SYM = "0123456789+-=()^*/,.;:$\\{}"


# -- synthetic text ------------------------------------------------------------------------------------------------
def word(r: random.Random) -> str:
    x = r.random()
    if x < 0.75:
        return "".join(r.choice(LOW) for _ in range(r.randint(1, 8)))
    if x < 0.85:
        return "".join(r.choice(LOW.upper() + LOW) for _ in range(r.randint(1, 6)))
    return "".join(r.choice(SYM + LOW) for _ in range(r.randint(1, 6)))


def text(r: random.Random, n: int) -> str:
    return " ".join(word(r) for _ in range(n))


def answer(r: random.Random) -> str:
    """Short answers of the shapes math answers take: integers, fractions, pairs, polynomials, words."""
    c = r.randint(0, 5)
    if c == 0:
        return str(r.randint(0, 99999))
    if c == 1:
        return "\\frac{%d}{%d}" % (r.randint(1, 99), r.randint(2, 99))  # noqa: UP031
    if c == 2:
        return "(%d,%d)" % (r.randint(-9, 9), r.randint(-9, 9))  # noqa: UP031
    if c == 3:
        return "%s^%d+%d" % (r.choice("xyzabn"), r.randint(2, 5), r.randint(1, 20))  # noqa: UP031
    if c == 4:
        return "\\text{%s}" % word(r).capitalize()  # noqa: UP031
    return "".join(r.choice(LOW + "0123456789") for _ in range(r.randint(1, 10)))


def block(problem: str, solution: str, ans: str) -> str:
    """One library entry as the default prefix template renders it."""
    return f"Problem: {problem}\nSolution: {solution} The answer is: {ans}\n"


def family_problem(fam: str, item: int) -> str:
    return f"{fam} code of item {item}?"


def family_solution(fam: str) -> str:
    return f"All {fam} items share one code."


def new_family(r: random.Random) -> tuple[str, str]:
    """(name, code): the code is what only a family's solved examples reveal."""
    return "".join(r.choice(LOW) for _ in range(r.randint(3, 7))), answer(r)


def example(r: random.Random, scale: float) -> tuple[str, str]:
    """(context text ending with "Answer:", the answer): a training or evaluation sample."""
    if r.random() < 0.25:  # transfer
        fam, code = new_family(r)
        items = r.sample(range(1, 1000), 4)
        blocks = [block(family_problem(fam, i), family_solution(fam), code) for i in items[: r.randint(1, 2)]]
        if r.random() < 0.3:
            blocks.insert(
                r.randint(0, len(blocks)), block(text(r, r.randint(2, 8)), text(r, r.randint(1, 10)), answer(r))
            )
        return "".join(blocks) + f"\nQuestion: {family_problem(fam, items[3])}\nAnswer:", code
    problem = text(r, r.randint(2, max(2, int(20 * scale))))
    ans = answer(r)
    blocks = []
    if r.random() >= 0.8:  # a second, unrelated block: copy from the one that matches
        blocks.append(
            block(
                text(r, r.randint(2, max(2, int(20 * scale)))),
                text(r, r.randint(1, max(1, int(40 * scale)))),
                answer(r),
            )
        )
    blocks.insert(r.randint(0, len(blocks)), block(problem, text(r, r.randint(1, max(1, int(40 * scale)))), ans))
    return "".join(blocks) + f"\nQuestion: {problem}\nAnswer:", ans


# -- the model -----------------------------------------------------------------------------------------------------
def demo_config():
    """The demo model's Gemma-4 text config (the embedded model's tokenizer and special tokens)."""
    from kvgraft_cli.engine.tinymodel import build_config

    return build_config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=32,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        max_position_embeddings=8192,
    )


def encode(s: str) -> list[int]:
    """The byte-level tokenizer's ids (4 specials, then one id per byte), without building it."""
    from kvgraft_cli.engine.tinymodel import SPECIALS

    return [len(SPECIALS) + b for b in s.encode()]


BOS = 2


def _batch(rng: random.Random, size: int, scale: float):
    import torch

    xs, ys = [], []
    for _ in range(size):
        ctx, ans = example(rng, scale)
        c, t = [BOS] + encode(ctx), encode(f" {ans}\n")
        xs.append(c + t)
        ys.append([-100] * len(c) + t)  # the loss is on the answer tokens alone
    n = max(map(len, xs))
    return (torch.tensor([x + [0] * (n - len(x)) for x in xs]), torch.tensor([y + [-100] * (n - len(y)) for y in ys]))


def greedy_answer(model, ctx: str, max_new: int = 24) -> str:
    """Greedy continuation of a context up to a newline (what solve does with decode.stop ["\\n"])."""
    import torch

    ids, out = [BOS] + encode(ctx), []
    nl = encode("\n")[0]
    with torch.no_grad():
        for _ in range(max_new):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if t == nl or t == 1:
                break
            out.append(t)
            ids.append(t)
    return bytes(i - 4 for i in out if i >= 4).decode("utf-8", errors="replace").strip()


def train(steps: int, out: Path, schedule: int = 2500, log=print) -> Path:
    """Train from scratch (seeded, one thread) for ``steps`` steps of a ``schedule``-step curriculum, and write a
    checkpoint folder like the embedded model's."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from kvgraft_cli.engine.tinymodel import build_tokenizer

    torch.set_num_threads(1)
    torch.manual_seed(TRAIN_SEED)
    model = AutoModelForCausalLM.from_config(demo_config(), dtype=torch.float32, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(TRAIN_SEED)
    t0 = time.time()
    for step in range(1, steps + 1):
        scale = min(1.0, 0.05 + step / (schedule * 0.8))  # contexts grow to full length over 80% of the schedule
        x, y = _batch(rng, 16, scale)
        logits = model(input_ids=x).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps:
            log(f"step {step} scale {scale:.2f} answer loss {loss.item():.3f} ({time.time() - t0:.0f} s)")
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    ).save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    for p in out.iterdir():
        p.chmod(0o644)
    return out


def evaluate(model_dir: Path, n: int = 200) -> dict[str, float]:
    """Held-out accuracy (seed EVAL_SEED, never trained on): the samples as trained, and the same questions with
    their blocks removed (what the model can do without a library)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, attn_implementation="eager"
    ).eval()
    r = random.Random(EVAL_SEED)
    hits = {"recurring": [0, 0], "transfer": [0, 0], "recurring, no blocks": [0, 0], "transfer, no blocks": [0, 0]}
    for _ in range(n):
        ctx, ans = example(r, 1.0)
        kind = "transfer" if " code of item " in ctx.rsplit("\nQuestion: ", 1)[1] else "recurring"
        for label, c in ((kind, ctx), (f"{kind}, no blocks", "\nQuestion: " + ctx.rsplit("\nQuestion: ", 1)[1])):
            hits[label][0] += greedy_answer(model, c) == ans
            hits[label][1] += 1
    return {k: a / b for k, (a, b) in hits.items() if b}


def write_demo_files(outdir: Path, seed: int = DEMO_SEED, n_recurring: int = 40, n_families: int = 10) -> None:
    """The demo's library.jsonl (verified solved problems: recurring ones and 2 solved instances per family) and
    queries.jsonl (the recurring problems again, and a new instance of every family), from a seed never trained on."""
    r = random.Random(seed)
    library, queries = [], []
    for i in range(n_recurring):
        problem, ans = text(r, r.randint(4, 16)), answer(r)
        library.append(
            {
                "id": f"rec-{i:03d}",
                "problem": problem,
                "solution": f"{text(r, r.randint(8, 30))} The answer is: {ans}",
                "answer": ans,
            }
        )
        queries.append({"id": f"rec-{i:03d}", "problem": problem, "answer": ans})
    for f in range(n_families):
        fam, code = new_family(r)
        items = r.sample(range(1, 1000), 3)
        for j, item in enumerate(items[:2]):
            library.append(
                {
                    "id": f"fam-{f:02d}-{j}",
                    "problem": family_problem(fam, item),
                    "solution": f"{family_solution(fam)} The answer is: {code}",
                    "answer": code,
                }
            )
        queries.append({"id": f"fam-{f:02d}-new", "problem": family_problem(fam, items[2]), "answer": code})
    outdir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("library.jsonl", library), ("queries.jsonl", queries)):
        (outdir / name).write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps to train (the committed model: 2000)")
    ap.add_argument("--schedule", type=int, default=2500, help="length of the curriculum the steps follow")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--eval", type=Path, metavar="DIR", help="evaluate a trained checkpoint instead of training")
    ap.add_argument("--demo-files", type=Path, metavar="DIR", help="write the demo's library.jsonl and queries.jsonl")
    args = ap.parse_args()
    if args.demo_files:
        write_demo_files(args.demo_files)
        return
    if args.eval:
        for k, v in evaluate(args.eval).items():
            print(f"{k}: {100 * v:.1f}%")
        return
    train(args.steps, args.out, args.schedule, log=lambda m: print(m, flush=True))


if __name__ == "__main__":
    main()
