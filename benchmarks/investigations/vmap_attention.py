"""Which scaled-dot-product-attention kernels work under ``vmap``, forward and backward: the
question behind :func:`fedadapt.federation.client.grouped.attention_for_vmap`.

    python benchmarks/investigations/vmap_attention.py [--clients 10] [--batch 10] [--out table.md]

For each kernel (math, flash, memory-efficient, cuDNN) and precision (fp32, bf16), K clients'
attention at DeiT-S's shape (6 heads, 197 tokens, 64 per head) runs under ``torch.func.vmap``
with ``sdpa_kernel`` pinned to that kernel; the outputs and the gradients of q, k and v are
compared with the math kernel run one client at a time in fp32. Prints a Markdown table: the
largest relative error, or the first line of the error the kernel raised, and milliseconds per
forward + backward (median of 10 on the device).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.func import vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
           "memory-efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION}


def _grads(q, k, v, fn):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.float().square().sum().backward()
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def reference(q, k, v):
    """The math kernel, one client at a time, fp32."""
    with sdpa_kernel(SDPBackend.MATH):
        per = [_grads(q[i].float(), k[i].float(), v[i].float(),
                      F.scaled_dot_product_attention) for i in range(q.shape[0])]
    return [torch.stack([p[j] for p in per]) for j in range(4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    shape = (args.clients, args.batch, 6, args.tokens, 64)
    q, k, v = (torch.randn(shape, generator=gen).to(dev) for _ in range(3))
    ref = reference(q, k, v)
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "the CPU"
    rows = [f"Attention under `vmap` on {where} (torch {torch.__version__}): {args.clients} "
            f"clients x batch {args.batch}, 6 heads, "
            f"{args.tokens} tokens, 64 per head; error relative to the math kernel, one client "
            f"at a time in fp32\n",
            "| kernel | precision | forward + backward | max relative error | ms |",
            "|---|---|---|---|---|"]
    for name, kernel in KERNELS.items():
        for dtype in (torch.float32, torch.bfloat16):
            prec = "fp32" if dtype == torch.float32 else "bf16"
            qs, ks, vs = (t.to(dtype) for t in (q, k, v))

            def step(kernel=kernel, qs=qs, ks=ks, vs=vs):
                with sdpa_kernel(kernel):
                    return _grads(qs, ks, vs, vmap(F.scaled_dot_product_attention))
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = step()
                loops = any("batching rule" in str(w.message) for w in caught)
                err = max(float((g - r).abs().max() / r.abs().max().clamp(min=1e-12))
                          for g, r in zip(got, ref))
                times = []
                for _ in range(10):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                how = "works, looping over the clients (no batching rule)" if loops else "works"
                rows.append(f"| {name} | {prec} | {how} | {err:.1e} | "
                            f"{statistics.median(times):.2f} |")
            except Exception as exc:  # the kernel's own refusal, in one line
                text = (str(exc).strip().splitlines() or [""])[0][:120]
                rows.append(f"| {name} | {prec} | fails: {type(exc).__name__}: {text} | | |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")


if __name__ == "__main__":
    main()
