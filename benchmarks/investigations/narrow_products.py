"""A per-slot product with few output columns on the CPU, plain and transposed: the figures
behind ``fedadapt.grouping.forms.NARROW_COLUMNS`` (docs/speed.md, "Narrow products on the CPU").

    python benchmarks/investigations/narrow_products.py [--repeats 5] [--record narrow-products]

A grouped step computes each slot's rows through its own weight as one batched product,
``x [n, B, in] @ w [n, in, out]`` (:func:`fedadapt.grouping.forms.slot_matmul`). MKL's GEMM is
slow when the right-hand side is narrow (a classifier's ``out`` = 10 classes); the transposed
product, ``(w^T @ x^T)^T``, makes the narrow side the product's rows, forward and backward.
Each case times one forward and backward (the weight's and the bias's gradients; ``x`` holds
features, no gradient) in the torch threads this machine's cores give, both forms of a shape
interleaved; the table gives the medians in microseconds, the ratio, and which form fedadapt
takes."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

COLUMNS = ["slots x rows", "in", "out", "plain (us)", "transposed (us)", "transposed / plain",
           "fedadapt takes"]
#: (slots, rows a slot, in, out): W3's head (10 clients, batch 32, EfficientNet-Lite0's 1,280
#: features, 10 classes), around it in ``out``, a DeiT-S-wide head, and narrow heads on few
#: inputs (W1's small CNN: 32 features, 5 clients side by side).
SHAPES = [(10, 32, 1280, o) for o in (1, 4, 8, 10, 12, 15, 16, 24, 32, 62)] + [
    (10, 64, 1280, 10), (32, 32, 384, 10), (10, 32, 384, 100), (5, 32, 32, 10),
    (10, 32, 64, 10), (10, 32, 128, 10)]


def step(x3: torch.Tensor, w: torch.Tensor, b: torch.Tensor, transposed: bool) -> None:
    y = (torch.baddbmm(b.mT, w.mT, x3.mT).mT if transposed else torch.baddbmm(b, x3, w))
    y.sum().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=200, help="forward-backward calls a repeat")
    p.add_argument("--record", default=None, help="keep the table as benchmarks/records/NAME.json")
    a = p.parse_args()
    from fedadapt.grouping.forms import NARROW_COLUMNS, NARROW_MIN_IN, narrow

    rows = []
    for i, (n, rows_a_slot, d_in, d_out) in enumerate(SHAPES):
        gen = torch.Generator().manual_seed(i)
        x3 = torch.randn(n, rows_a_slot, d_in, generator=gen)
        w = torch.randn(n, d_in, d_out, generator=gen).requires_grad_()
        b = torch.zeros(n, 1, d_out).requires_grad_()
        took: dict[bool, list[float]] = {False: [], True: []}
        for form in (False, True):  # warm-up
            for _ in range(10):
                step(x3, w, b, form)
        for _ in range(a.repeats):
            for form in (False, True):
                t = time.perf_counter()
                for _ in range(a.calls):
                    step(x3, w, b, form)
                took[form].append((time.perf_counter() - t) / a.calls * 1e6)
        plain, trans = statistics.median(took[False]), statistics.median(took[True])
        rows.append([f"{n} x {rows_a_slot}", str(d_in), str(d_out), f"{plain:.0f}",
                     f"{trans:.0f}", f"{trans / plain:.2f}",
                     "transposed" if narrow(d_out, d_in) else "plain"])
        print(f"[narrow-products] {i + 1}/{len(SHAPES)}: {' | '.join(rows[-1])}", file=sys.stderr,
              flush=True)
    from fedadapt.results import records

    records.show(
        a.record, COLUMNS, rows,
        command="python benchmarks/investigations/narrow_products.py " + " ".join(sys.argv[1:]),
        source="benchmarks/investigations/narrow_products.py", writer="narrow_products",
        footer=f"One forward and backward of `baddbmm` (weight and bias gradients), fp32, "
               f"medians of {a.repeats} interleaved repeats of {a.calls} calls, torch "
               f"threads: {torch.get_num_threads()}. fedadapt takes the transposed form on "
               f"the CPU below {NARROW_COLUMNS} output columns with {NARROW_MIN_IN} inputs "
               f"or more.")

if __name__ == "__main__":
    main()
