"""Synthetic image domains for offline domain-generalisation evidence.

A grayscale data set (Fashion-MNIST, scikit-learn's digits) is turned into four domains, each a
disjoint random subset of the images drawn in its own style: ``original``, ``inverted``
(``255 - x``), ``edges`` (Sobel gradient magnitude) and ``noisy`` (Gaussian noise).
"""

from __future__ import annotations

import numpy as np

DOMAIN_KINDS = ("original", "inverted", "edges", "noisy")
#: Standard deviation of the ``noisy`` domain's Gaussian noise, on the 0..255 scale.
NOISE_SIGMA = 60.0


def sobel_magnitude(images: np.ndarray) -> np.ndarray:
    """Sobel gradient magnitude of each ``[N, H, W]`` image (edges padded by replication)."""
    x = np.pad(images.astype(np.float64), ((0, 0), (1, 1), (1, 1)), mode="edge")

    def shifted(dy: int, dx: int) -> np.ndarray:  # x[y + dy, x + dx] for every pixel
        h, w = images.shape[1:]
        return x[:, 1 + dy:1 + dy + h, 1 + dx:1 + dx + w]

    gx = (shifted(-1, 1) + 2 * shifted(0, 1) + shifted(1, 1)
          - shifted(-1, -1) - 2 * shifted(0, -1) - shifted(1, -1))
    gy = (shifted(1, -1) + 2 * shifted(1, 0) + shifted(1, 1)
          - shifted(-1, -1) - 2 * shifted(-1, 0) - shifted(-1, 1))
    return np.hypot(gx, gy)


def render_domain(images: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Draw uint8 ``[N, H, W]`` images in the style ``kind`` (one of :data:`DOMAIN_KINDS`).

    ``edges`` rescales each image's gradient magnitude to 0..255 (a flat image gives zeros);
    ``noisy`` adds N(0, 60) noise from ``rng`` and clips to 0..255.
    """
    images = np.asarray(images, dtype=np.uint8)
    if kind == "original":
        return images.copy()
    if kind == "inverted":
        return 255 - images
    if kind == "edges":
        mag = sobel_magnitude(images)
        peak = mag.max(axis=(1, 2), keepdims=True)
        scaled = np.divide(mag * 255.0, peak, out=np.zeros_like(mag), where=peak > 0)
        return np.round(scaled).astype(np.uint8)
    if kind == "noisy":
        noisy = images + rng.normal(0.0, NOISE_SIGMA, size=images.shape)
        return np.clip(np.round(noisy), 0, 255).astype(np.uint8)
    raise ValueError(f"unknown domain kind {kind!r} (known: {', '.join(DOMAIN_KINDS)})")


def make_domains(images: np.ndarray, labels: np.ndarray, per_domain: int, seed: int = 0,
                 kinds: tuple[str, ...] = DOMAIN_KINDS) -> dict:
    """Disjoint random subsets of ``per_domain`` images, one per kind, each rendered.

    Returns columns ``image`` (list of uint8 ``[H, W]`` arrays), ``label``, ``domain`` (kind
    name) and ``source_index`` (the row of ``images`` each sample was drawn from).
    """
    n = len(images)
    per_domain = min(per_domain, n // len(kinds))
    if per_domain < 1:
        raise ValueError(f"{n} images cannot make {len(kinds)} disjoint domains")
    order = np.random.default_rng(seed).permutation(n)
    cols: dict = {"image": [], "label": [], "domain": [], "source_index": []}
    for k, kind in enumerate(kinds):
        rows = np.sort(order[k * per_domain:(k + 1) * per_domain])
        drawn = render_domain(images[rows], kind, np.random.default_rng([seed, k]))
        cols["image"].extend(drawn)
        cols["label"].extend(np.asarray(labels)[rows].astype(int).tolist())
        cols["domain"].extend([kind] * len(rows))
        cols["source_index"].extend(rows.tolist())
    return cols
