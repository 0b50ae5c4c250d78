"""``fedadapt-bench --iciia``: ICIIA's Table 2, the latency and memory of recognising one image."""

from __future__ import annotations

import statistics

import torch

from fedadapt.bench.common import table, write
from fedadapt.results.records import machine


def iciia_latency(overrides: list[str], repeats: int) -> dict:
    """ICIIA Table 2: recognising ONE image with the backbone alone, and with the backbone plus
    the module attending 15 cached features (ICIIA-B and -T): median latency over ``repeats``
    (after 5 warm-up runs) and peak memory of live tensors (parameters included; CPU: the
    dispatcher tracker of ``fedadapt.budget``; GPU: ``max_memory_allocated``)."""
    from fedadapt.adapters import build_model
    from fedadapt.backbones import build_backbone
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.federation.client.training import device
    from fedadapt.measure import peak_bytes, time_calls

    dev = torch.device(device())
    results = {}
    for preset in ("iciia_b", "iciia_t"):
        run = to_run_config(compose_config(["experiment=iciia_offline", f"method={preset}",
                                            *overrides]))
        backbone = build_backbone(run.backbone).to(dev)
        module = build_model(run.method, backbone, 10, with_backbone=False).head.module
        module = module.to(dev).eval()
        size = run.backbone.image_size
        image = torch.randn(1, 3, size, size, device=dev)
        history = torch.randn(run.method.images - 1, backbone.embed_dim, device=dev)
        variants = {"backbone alone": lambda b=backbone, x=image: b(x),
                    f"backbone + {preset} (15 cached)":
                        lambda b=backbone, m=module, x=image, h=history:
                            m.predict_one(h, b(x)[0])}
        for name, fn in variants.items():
            if name in results:
                continue
            with torch.no_grad():
                for _ in range(5):
                    fn()
                times = time_calls(fn, repeats, dev)
                peak = peak_bytes(fn, dev, baseline=lambda n=name, b=backbone, h=history,
                                  m=module: [*b.parameters(), h,
                                             *([] if n == "backbone alone" else m.parameters())])
            results[name] = {"median_ms": 1e3 * statistics.median(times), "peak_mb": peak / 1e6,
                             "module_params": 0 if name == "backbone alone" else
                             sum(p.numel() for p in module.parameters())}
    return results


def run(args) -> None:
    res = iciia_latency(args.overrides, max(args.repeats, 20))
    meta = {"results": res, "repeats": max(args.repeats, 20), "machine": machine()}
    table(args, ["recognising one image", "median latency ms", "peak memory MB",
                  "module params"],
           [[name, f"{r['median_ms']:.2f}", f"{r['peak_mb']:.1f}", f"{r['module_params']:,}"]
            for name, r in res.items()], meta)
    write(args.out, "bench-iciia", meta)

