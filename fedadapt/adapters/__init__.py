"""Trainable methods, one module each, registered by name with a typed config (PEFT's pattern).

A method turns a frozen :class:`~fedadapt.backbones.Backbone` into an :class:`AdaptedModel` and
says which of its tensors train, which travel to the server and which stay on the client.
Adding a client-trained method is a new module here (plus its ``conf/method/<name>.yaml`` and
its tests; docs/adding-a-method.md): modules are found, not listed, and nothing branches on
method names. Methods trained on the server belong to their family in :mod:`fedadapt.methods`.
"""

from __future__ import annotations

from fedadapt.adapters.model import AdaptedModel
from fedadapt.adapters.registry import (
    METHODS,
    MethodSpec,
    build_model,
    load_methods,
    method_spec,
    register_method,
)

__all__ = ["AdaptedModel", "METHODS", "MethodSpec", "build_model", "load_methods",
           "method_spec", "register_method"]
