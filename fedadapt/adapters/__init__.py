"""Trainable methods, one module each, registered by name with a typed config (PEFT's pattern).

A method turns a frozen :class:`~fedadapt.backbones.Backbone` into an :class:`AdaptedModel` and
says which of its tensors train, which travel to the server and which stay on the client.
Adding a method is a new module here (plus its ``conf/method/<name>.yaml`` and a row in the test
matrix); nothing else branches on method names.
"""

from __future__ import annotations

from fedadapt.adapters import cdc_mmpg, duet, exits, fedclip, heads, iciia  # noqa: F401,I001  (registration)
from fedadapt.adapters.model import AdaptedModel
from fedadapt.adapters.registry import (
    METHODS,
    MethodSpec,
    build_model,
    method_spec,
    register_method,
)

__all__ = ["AdaptedModel", "METHODS", "MethodSpec", "build_model", "method_spec",
           "register_method"]
