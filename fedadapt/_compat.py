"""torchvision compatibility shim, imported first by :mod:`fedadapt`.

Why this exists
---------------
The registry's ``torchvision==0.28.0`` wheel is a CUDA build. Next to the CPU build of
``torch==2.13.0`` that this project pins (pyproject.toml; docs/getting-started.md, "Pins"),
its compiled extension ``torchvision/_C.so`` fails to load, its operators never register, and
``import torchvision`` dies with ``operator torchvision::nms does not exist``
(``torchvision/_meta_registrations.py`` registers fake kernels for ops it expects to exist).
That also breaks timm, open_clip and the transformers vision models, which all import
torchvision.

What it does
------------
1. If ``torchvision`` is not installed, or its ops are already registered, nothing.
2. Otherwise it tries ``torch.ops.load_library`` on torchvision's own ``_C`` extension. Where torch
   and torchvision match (any normal CPU or CUDA install) that succeeds and the shim is a no-op.
3. Only if that fails does it declare the schemas of the two operators that torchvision's Python
   import touches (``nms`` and ``qnms``) with ``torch.library``, so the import succeeds. The
   operators then have no kernel: torchvision's detection ops (nms, roi_align, ...) stay
   unavailable, and its JPEG/PNG decoders too (fedadapt decodes images with PIL). Transforms
   and model definitions work.

It must run before anything imports torchvision, and in every Ray worker, which is why
``fedadapt/__init__.py`` imports it before anything else.
"""

from __future__ import annotations

import glob
import importlib.util
import os

#: True when the shim had to declare operator schemas (torchvision's kernels are missing).
TORCHVISION_OPS_STUBBED = False

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = None  # keep the torch.library.Library alive for the life of the process


def _ops_registered() -> bool:
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - attribute lookup raises if undefined
    except (AttributeError, RuntimeError):
        return False
    return True


def apply() -> bool:
    """Make ``import torchvision`` work; return True if schemas had to be declared."""
    global TORCHVISION_OPS_STUBBED, _LIBRARY
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or _ops_registered():
        return TORCHVISION_OPS_STUBBED
    import torch

    for lib in glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")):
        try:
            torch.ops.load_library(lib)
        except (OSError, RuntimeError):
            continue
        if _ops_registered():
            return False  # a matching install: the real kernels are loaded
    _LIBRARY = torch.library.Library("torchvision", "DEF")  # noqa: TOR901
    for schema in _SCHEMAS.values():
        _LIBRARY.define(schema)
    TORCHVISION_OPS_STUBBED = True
    return True


apply()
