"""Which torch ops give a row (or an element) the same bits however many rows are computed together, under the
kernel flags of this process (issue #13's groundwork for a faster invariant schedule than one token a forward).

Checks, on seeded random inputs:
  linear     F.linear on 300 rows vs the same rows split 179 + 121, and vs each row alone (M = 1)
  qk         the last 121 query rows of q @ k.T vs the same rows computed alone
  softmax    a row's softmax over 300 keys vs over the same keys plus 8 masked (-inf) ones
  elementwise   exp, cos, sin, tanh, silu, gelu, rsqrt of a 4,099-element tensor vs the same values sliced out
             (lengths 1..4,095, and 37-element slices at other offsets): does an element's bits depend on where
             it falls in the tensor (a vectorized body and a separately computed tail would make it so)?

Usage (flags are read when torch is imported: run it under the flags you want to know about):
    python scripts/row_invariance.py                       # this machine's native flags
    MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 python scripts/row_invariance.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # bytes, not values (-0.0 vs 0.0 differ)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"threads {torch.get_num_threads()}"
    )
    x = torch.randn(300, 576, generator=g)
    w = torch.randn(192, 576, generator=g)
    full = F.linear(x, w)
    split = torch.cat([F.linear(x[:179], w), F.linear(x[179:], w)])
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(300)])
    print(
        f"linear: 179+121 split {'same' if _same(full, split) else 'DIFFERS'}, "
        f"rows alone {'same' if _same(full, alone) else 'DIFFERS'}"
    )
    q, k = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    print(f"qk: last 121 query rows {'same' if _same((q @ k.T)[179:], q[179:] @ k.T) else 'DIFFERS'}")
    s = torch.randn(4, 300, generator=g)
    padded = torch.cat([s, torch.full((4, 8), float("-inf"))], dim=1)
    soft = torch.softmax(padded, dim=-1)[:, :300]
    print(f"softmax: 8 masked keys added {'same' if _same(torch.softmax(s, dim=-1), soft) else 'DIFFERS'}")
    v = torch.randn(4099, generator=g) * 10
    ops = {
        "exp": torch.exp,
        "cos": torch.cos,
        "sin": torch.sin,
        "tanh": torch.tanh,
        "silu": F.silu,
        "gelu": F.gelu,
        "rsqrt": lambda t: torch.rsqrt(t.abs() + 0.1),
    }
    for name, fn in ops.items():
        whole, bad, total = fn(v), 0, 0
        for n in (1, 3, 7, 9, 13, 17, 100, 1001, 4095):
            bad += not _same(fn(v[:n].clone()), whole[:n])
            bad += not _same(fn(v[n : n + 37].clone()), whole[n : n + 37])
            total += 2
        print(f"elementwise {name}: {bad} of {total} slices differ")


if __name__ == "__main__":
    main()
