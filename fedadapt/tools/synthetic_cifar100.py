"""A CIFAR-100-shaped data set made on the spot, for timing the Accumulator's Table 1 shape where
the hub cannot be reached (a lent GPU machine has no network).

    python -m fedadapt.tools.synthetic_cifar100 OUT [--train 50000] [--test 10000] [--seed 0]
    fedadapt experiment=acc_conventional backbone.weights=null dataset.path=OUT ...
    python -m fedadapt.tools.synthetic_cifar100 OUT --like pacs [--train 2000]
    fedadapt experiment=fedclip_pacs backbone.weights=null dataset.path=OUT ...

A ``DatasetDict(train, test)`` folder (``save_to_disk``) with CIFAR-100's columns (``img``: 32x32
RGB PNG, ``fine_label``: 100 classes, ``coarse_label``: 20), as ``uoft-cs/cifar100`` has them,
so ``dataset=cifar100 dataset.path=OUT`` loads it as it would the real one. Each class is a
seeded colour and stripe pattern plus noise: a model can learn it, and nothing it reports is a
CIFAR-100 result. Timing only.

``--like pacs``: PACS's shape instead (``--train`` images over its 4 domains and 7 classes,
64x64 PNGs in ``OUT/<domain>/<class>/``, the DomainBed layout ``dataset=pacs dataset.path``
reads), for timing FedCLIP's preset.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import time

import numpy as np


def images(labels: np.ndarray, seed: int) -> list[bytes]:
    """PNG-encoded 32x32 images of ``labels`` (a colour and stripes per class, seeded noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.random.default_rng(1234).integers(0, 256, (100, 1, 1, 3))  # a colour per class
    yy = np.arange(32).reshape(32, 1, 1)
    stripes = ((yy * (1 + np.arange(100) % 7).reshape(100, 1, 1, 1)) // 4 % 2) * 60  # per class
    out = []
    for c in labels:
        noise = rng.integers(-40, 41, (32, 32, 3))
        pixels = np.clip(base[c] + stripes[c] + noise, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
        out.append(buf.getvalue())
    return out


def encoded(labels: np.ndarray, seed: int) -> list[bytes]:
    """:func:`images` in chunks of 2,000 over the machine's cores (each chunk its own seed, so
    the result does not depend on the core count)."""
    from concurrent.futures import ProcessPoolExecutor

    chunks = [labels[i:i + 2000] for i in range(0, len(labels), 2000)]
    with ProcessPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1)) as pool:
        parts = pool.map(images, chunks, [seed * 1_000_003 + i for i in range(len(chunks))])
        return [b for part in parts for b in part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=50_000)
    parser.add_argument("--test", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--like", choices=("cifar100", "pacs"), default="cifar100")
    args = parser.parse_args()
    if args.like == "pacs":
        return pacs(args.out, args.train, args.seed)
    if args.train < 1 or args.test < 1:
        sys.exit("synthetic_cifar100: --train and --test must be >= 1")
    import datasets
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    features = Features({"img": Image(), "fine_label": ClassLabel(num_classes=100),
                         "coarse_label": ClassLabel(num_classes=20)})
    splits = {}
    for i, (split, n) in enumerate((("train", args.train), ("test", args.test))):
        labels = rng.integers(0, 100, n)
        data = encoded(labels, args.seed * 2 + i)
        splits[split] = Dataset.from_dict(
            {"img": [{"bytes": b, "path": None} for b in data],
             "fine_label": labels.tolist(), "coarse_label": (labels // 5).tolist()},
            features=features)
    tmp = f"{args.out}.tmp-{os.getpid()}"
    DatasetDict(splits).save_to_disk(tmp)
    shutil.rmtree(args.out, ignore_errors=True)
    os.replace(tmp, args.out)  # whole or not at all
    print(f"synthetic_cifar100: {args.train:,} + {args.test:,} images in {args.out} "
          f"({time.perf_counter() - t0:.1f} s)")


PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")


def pacs(out: str, n: int, seed: int) -> None:
    """``n`` images in ``out/<domain>/<class>/<i>.png``, written whole or not at all."""
    from PIL import Image

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    tmp = f"{out}.tmp-{os.getpid()}"
    labels = rng.integers(0, len(PACS_CLASSES), n)
    domains = rng.integers(0, len(PACS_DOMAINS), n)
    for i, (data, c, d) in enumerate(zip(encoded(labels * 7, seed), labels, domains)):
        folder = os.path.join(tmp, PACS_DOMAINS[d], PACS_CLASSES[c])
        os.makedirs(folder, exist_ok=True)
        small = Image.open(io.BytesIO(data)).resize((64, 64))
        small.save(os.path.join(folder, f"{i}.png"), compress_level=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"synthetic_cifar100 --like pacs: {n:,} images in {out} "
          f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
