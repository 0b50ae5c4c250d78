"""Which of a model's trainable parts stay on each client: the classifier (FedPer, FedRep,
FedBABU), everything trained in front of it (LG-FedAvg), and FedBN's normalisation parameters
(:class:`fedadapt.config.PflConfig`; the kinds live in :mod:`fedadapt.pfl`).

On a frozen backbone the trainable parts are a head and the adapter, LoRA, token or tuner
tensors in front of it. The *head* is the classifier: every trainable linear map onto the
classes (one per exit for a model with exits; a cosine head's class weights). The *body* is the
rest of what trains. FedBN's normalisation parameters are the backbone's LayerNorm, GroupNorm
and BatchNorm weights and biases, unfrozen (their running statistics stay the pretrained ones:
the backbone runs in evaluation mode, as it always does here).
"""

from __future__ import annotations

from torch import nn

from fedadapt.config import ConfigError

#: The normalisation layers whose affine parameters ``pfl.norms`` trains.
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def head_names(model, num_classes: int) -> list[str]:
    """The classifier's trainable tensors: those of every linear layer mapping onto the
    ``num_classes`` classes and of a cosine head; none for a model whose classes are text
    features (FedCLIP's AttAI)."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == num_classes:
            names += [f"{prefix}.{n}" for n, p in module.named_parameters(recurse=False)
                      if p.requires_grad]
        elif getattr(module, "is_class_weights", False):  # a cosine head's class prototypes
            names += [f"{prefix}.{n}" for n, p in module.named_parameters(recurse=False)
                      if p.requires_grad]
    trainable = set(model.trainable_names())
    return [n for n in names if n in trainable]


def unfreeze_norms(model) -> list[str]:
    """FedBN on a frozen backbone: its normalisation layers' affine parameters train; their
    names. ConfigError when the model runs no backbone or it has no such layer."""
    if model.backbone is None:
        raise ConfigError("pfl.norms=true is invalid: the model runs on cached features (no "
                          "backbone, so no normalisation layer): add method.use_cache=false")
    if all(p.requires_grad for p in model.backbone.parameters()):
        raise ConfigError("pfl.norms=true is invalid: the method trains the whole backbone (its "
                          "norms among it, federated): nothing to keep personal beside it")
    names = []
    for prefix, module in model.backbone.named_modules():
        if isinstance(module, NORMS):
            for n, p in module.named_parameters(recurse=False):
                p.requires_grad_(True)
                names.append(f"backbone.{prefix}.{n}" if prefix else f"backbone.{n}")
    if not names:
        raise ConfigError(f"pfl.norms=true is invalid: the backbone "
                          f"({type(model.backbone).__name__}) has no LayerNorm, GroupNorm or "
                          f"BatchNorm with affine parameters")
    model.adapts_backbone = True  # its forward now needs gradients inside the backbone
    return names


def keep_on_client(model, keeps: str, norms: bool, num_classes: int, kind: str = "...") -> None:
    """Mark the part ``keeps`` (``""``, ``head``, ``body``) and, with ``norms``, the backbone's
    normalisation parameters as personal: they never leave a client (``pfl.*``). ConfigError
    where the model has no such part, or nothing would be federated (naming ``pfl=kind``)."""
    if not keeps and not norms:
        return
    kept = set(unfreeze_norms(model)) if norms else set()
    if keeps:
        head = set(head_names(model, num_classes))
        if not head:
            raise ConfigError(f"pfl={kind} keeps the classifier (the head) on each client, and "
                              f"this method has no trainable classifier (its classes are text "
                              f"features): choose a method with a head")
        body = {n for n in model.trainable_names() if n not in head and n not in kept}
        if not body:
            raise ConfigError(f"pfl={kind} keeps the {keeps} on each client and federates the "
                              f"{'head' if keeps == 'body' else 'body'}, and this method trains "
                              f"its head only (nothing in front of it): choose a method with "
                              f"adapters, LoRA or a hidden layer (e.g. method=mlp_head)")
        kept |= head if keeps == "head" else body
    model.personal_extra = frozenset(kept)
    if not model.communicated_names():
        raise ConfigError("pfl: every trainable tensor would stay on the clients (nothing is "
                          "federated); use method=local_only for that")


def body_names(model, num_classes: int) -> list[str]:
    """Everything the model trains except its classifier and FedBN's norms (which
    :func:`keep_on_client` marked personal)."""
    head = set(head_names(model, num_classes))
    return [n for n in model.trainable_names()
            if n not in head and n not in model.personal_extra]
