"""DUET (``duet.txt``): a server-side hypernetwork that generates a device's classifier (its
"dynamic layers") from the device's real-time samples; the backbone ("static layers") stays
frozen and nothing trains on the device.

Personalized Parameters Generator (PPG, Sec. 3.3.2), for a session of K real-time samples:

    e^(n) = L_layer^(n)(E_share(S_R))                      (Eq. 5)
    w^(n) = (W1 e^(n) + B1) W2 + B2                        (Eq. 6)

``E_share`` is a shared encoder neck: a per-sample MLP whose outputs are averaged over the
session's samples; ``L_layer^(n)`` is one linear layer per dynamic layer; the generator of layer
n is the two linear layers of Eq. 6 and emits that layer's weights and bias. The dynamic layers
are ``D -> hidden... -> C`` with Tanh between them (as the authors' code applies its generated
MLP), applied per session by batched matmul. Generated weights are scaled by 1/sqrt(fan-in), so a
generated layer starts at the scale of ``nn.Linear``'s initialisation (Chang et al.'s principled
hypernetwork initialisation; the paper does not give one).

Stable Weight Adapter (SWA, Sec. 3.3.3): every layer has ``N_p`` generators; the first layers'
weights W'_1,j, flattened, give the self-similarity S = W'_1 W'_1^T; its row sums p' go through
``softmax((p'_i / tau) / sum_j p'_j)`` (Eq. 8) and the final generator's parameters are the
p-weighted sums of the N_p generators' (Eq. 9: W1 and W2, and their biases alike). N_p = 1 is
DUET without SWA.

Training (Eq. 7) weights the cross-entropy of the t-th scored sample of a session by gamma^t.
The layers are generated from the samples the device uploads (``method.context``: the session's
first samples, as the paper's "the first frame of each video is set to a real-time sample"; the
client's previous session; or, transductively, the session itself) and the loss is on the
samples they were not generated from (with ``context=session``, on the same ones), as on a
device at test time.

SWA's p depends only on the generators' first-layer weights (Eq. 8), not on the session: one p
per dynamic layer serves every session (:meth:`Duet.swa_weights`). With tau = 1 the softmax
inputs p'_i / sum_j p'_j sum to one, so they differ by less than one and p is close to uniform;
a smaller tau sharpens it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.adapters.model import AdaptedModel
from fedadapt.adapters.registry import register_method
from fedadapt.config import MethodConfig, ServerTrainConfig, check, check_server_train

UPLOADS = ("embeddings", "samples")
#: Which samples the generator sees (``method.context``); every row scores only the others.
CONTEXTS = ("first", "previous", "session")


@dataclass
class SessionPluginConfig(MethodConfig, ServerTrainConfig):
    """What the session plug-ins (DUET, CDC-MMPG) share: sessions, server training, baselines
    and what the device uploads. Trained once on the server (``fedadapt.methods.sessions.train``)
    from the foundation's cached features."""

    #: K, the samples of a session (the device's real-time samples).
    session: int = 8
    #: Which samples the generator sees, i.e. what the device uploads; every row of a run (the
    #: generated layers, the original model, fine-tuning) scores only the samples the generator
    #: did not see. ``first``: the session's first ``context_size`` samples (DUET's "the first
    #: frame of each video is set to a real-time sample"), the session's other samples are
    #: scored; ``previous``: the client's previous session, the whole current session is scored
    #: (a client's first session has none: the original model scores it in every row);
    #: ``session``: the session itself, which is also what is scored (transductive: the layers
    #: classify the very samples they were generated from).
    context: str = "first"
    #: ``context=first``: how many of the session's first samples the generator sees.
    context_size: int = 1
    #: What the device uploads: its samples' ``embeddings`` (the backbone's features) or the raw
    #: ``samples`` (the server runs the frozen backbone on them).
    upload: str = "embeddings"
    #: Server training: Adam(W), early stopping on the clients' validation sessions.
    lr: float = 1e-3
    max_epochs: int = 50
    patience: int = 5
    sessions_per_step: int = 32
    #: The original model (the classifier trained on every client's history, SGD) and the
    #: fine-tuning baseline: each test session's classifier fine-tuned on the labels of the
    #: samples the generator sees (``context``; with ``context=session``, of the client's
    #: previous session, since the session's own labels are what is scored); 0 steps = skip.
    classifier_epochs: int = 30
    classifier_lr: float = 0.01
    finetune_steps: int = 10
    finetune_lr: float = 0.01
    #: Binary tasks: every client reports its own AUC (the summary's ``auc``: their mean).
    #: With ``auc_bins`` > 0 it also sends, per class, a histogram of its scores' log-odds in
    #: that many bins over [-16, 16], and the server pools them into the AUC over all clients'
    #: samples (``auc_pooled``; scores sharing a bin count as ties, ``auc_tie_bound`` bounds the
    #: error). 0: no histograms (a server that can recompute the scores could read the class
    #: of a sample alone in its bin from them).
    auc_bins: int = 0


def check_session_plugin(cfg: SessionPluginConfig) -> None:
    check_server_train(cfg, "method")
    check(cfg.momentum == 0, "method.momentum", cfg.momentum,
          "must be 0: session plug-ins train with AdamW, which has no momentum")
    for key in ("session", "sessions_per_step", "classifier_epochs"):
        check(getattr(cfg, key) >= 1, f"method.{key}", getattr(cfg, key), "must be >= 1")
    for key in ("classifier_lr", "finetune_lr"):
        check(getattr(cfg, key) > 0, f"method.{key}", getattr(cfg, key), "must be > 0")
    check(cfg.finetune_steps >= 0, "method.finetune_steps", cfg.finetune_steps, "must be >= 0")
    check(cfg.auc_bins == 0 or cfg.auc_bins >= 2, "method.auc_bins", cfg.auc_bins,
          "0 (no histograms) or >= 2")
    check(cfg.upload in UPLOADS, "method.upload", cfg.upload, f"one of {UPLOADS}")
    check(cfg.context in CONTEXTS, "method.context", cfg.context, f"one of {CONTEXTS}")
    check(cfg.context_size >= 1, "method.context_size", cfg.context_size, "must be >= 1")
    check(cfg.context != "first" or cfg.context_size < cfg.session, "method.context_size",
          cfg.context_size, f"must be < method.session={cfg.session} with method.context=first "
          f"(the session's other samples are the ones scored; none would be left)")
    check(cfg.use_cache, "method.use_cache", cfg.use_cache,
          "session plug-ins train on the foundation's cached features")


@dataclass
class DuetConfig(SessionPluginConfig):
    name: str = "duet"
    #: Hidden widths of the dynamic layers (``[]``: one linear layer D -> C).
    dynamic_hidden: list[int] = field(default_factory=list)
    #: N_p generators per dynamic layer (SWA); 1 = DUET without SWA.
    generators: int = 5
    #: tau, SWA's softmax temperature (Eq. 8; the paper gives no value). At tau = 1 the
    #: softmax inputs sum to one and p is uniform to 1e-3 (SWA is a plain average); 0.01 gave
    #: the best mean of a sweep over 1 / 0.1 / 0.03 / 0.01 / 0.003 on duet_offline (3 seeds,
    #: within one standard deviation of the others), with p still a mixture (0.003: one-hot).
    temperature: float = 0.01
    #: gamma, the weight gamma^t of the t-th sample of a session in the loss (Eq. 7).
    gamma: float = 1.0
    #: Widths: the shared encoder neck, the per-layer embedding C_z, the generator's first layer.
    neck: int = 256
    embed: int = 64
    generator_hidden: int = 64

    def check(self) -> None:
        _check(self)


def layer_shapes(dim: int, hidden: list[int], num_classes: int) -> list[tuple[int, int]]:
    """``(out, in)`` of every dynamic layer: ``D -> hidden... -> C``."""
    widths = [dim, *hidden, num_classes]
    return [(widths[i + 1], widths[i]) for i in range(len(widths) - 1)]


def apply_dynamic(layers: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The device's dynamic layers on features ``x``; Tanh between layers.

    One session: weights ``[out, in]``, biases ``[out]``, ``x`` ``[K, D]``. A batch of sessions:
    weights ``[S, out, in]``, biases ``[S, out]``, ``x`` ``[S, K, D]`` (batched matmul)."""
    for i, (w, b) in enumerate(layers):
        x = torch.matmul(x, w.transpose(-1, -2)) + b.unsqueeze(-2)
        if i < len(layers) - 1:
            x = torch.tanh(x)
    return x


def masked_mean(x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean over dim -2 of ``[S, K, H]``, skipping padding (``mask`` ``[S, K]``, True = pad)."""
    if mask is None:
        return x.mean(-2)
    keep = (~mask).unsqueeze(-1).to(x.dtype)
    return (x * keep).sum(-2) / keep.sum(-2).clamp_min(1.0)


def swa_weights(first_layers: torch.Tensor, temperature: float) -> torch.Tensor:
    """SWA's p (Eq. 8) from the N_p generators' first-layer weights ``[N_p, ...]``."""
    w = first_layers.flatten(1)
    s = w @ w.T                                  # self-similarity, [N_p, N_p]
    p = s.sum(1)                                 # p'
    # sum_j p'_j = ||sum_i w_i||^2 >= 0; the floor only guards a degenerate all-zero start
    return torch.softmax((p / temperature) / p.sum().clamp_min(1e-12), dim=0)


class LayerGenerator(nn.Module):
    """N_p two-layer generators (Eq. 6) for one dynamic layer of shape ``(out, in)``."""

    def __init__(self, shape: tuple[int, int], embed: int, hidden: int, generators: int) -> None:
        super().__init__()
        self.shape = shape
        n_out = shape[0] * shape[1] + shape[0]
        self.w1 = nn.Parameter(torch.empty(generators, hidden, embed))
        self.b1 = nn.Parameter(torch.empty(generators, hidden))
        self.w2 = nn.Parameter(torch.empty(generators, n_out, hidden))
        self.b2 = nn.Parameter(torch.empty(generators, n_out))
        for w, b in ((self.w1, self.b1), (self.w2, self.b2)):  # nn.Linear's init, per generator
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    @property
    def generators(self) -> int:
        return self.w1.shape[0]

    def weights(self, temperature: float) -> torch.Tensor:
        if self.generators == 1:
            return self.w1.new_ones(1)
        return swa_weights(self.w1, temperature)

    def forward(self, e: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``e`` ``[S, C_z]`` -> weights ``[S, out, in]`` and bias ``[S, out]``."""
        p = self.weights(temperature)
        w1, b1, w2, b2 = (torch.einsum("j,j...->...", p, t)
                          for t in (self.w1, self.b1, self.w2, self.b2))   # Eq. 9
        flat = F.linear(F.linear(e, w1, b1), w2, b2)                       # Eq. 6
        out, inp = self.shape
        weight = flat[:, :out * inp].reshape(-1, out, inp) / math.sqrt(inp)
        return weight, flat[:, out * inp:]


class Duet(nn.Module):
    """The PPG with SWA: a session's samples ``[S, K, D]`` -> every dynamic layer's parameters."""

    def __init__(self, dim: int, num_classes: int, *, hidden: list[int], generators: int,
                 temperature: float, neck: int, embed: int, generator_hidden: int) -> None:
        super().__init__()
        self.dim, self.num_classes, self.temperature = dim, num_classes, temperature
        self.shapes = layer_shapes(dim, list(hidden), num_classes)
        self.neck = nn.Sequential(nn.Linear(dim, neck), nn.ReLU(), nn.Linear(neck, neck))
        self.embeddings = nn.ModuleList(nn.Linear(neck, embed) for _ in self.shapes)
        self.generators = nn.ModuleList(LayerGenerator(s, embed, generator_hidden, generators)
                                        for s in self.shapes)

    def forward(self, frames: torch.Tensor, mask: Optional[torch.Tensor] = None
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shared = masked_mean(self.neck(frames), mask)                      # E_share, [S, H]
        return [gen(emb(shared), self.temperature)                         # Eq. 5, 6
                for emb, gen in zip(self.embeddings, self.generators)]

    # -- the plug-in interface (fedadapt.methods.sessions.train) ----------------------------
    def generate(self, upload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The server's answer for one session: the dynamic layers, named like the device's."""
        layers = self(upload["embeddings"].unsqueeze(0))
        return dynamic_arrays([(w[0], b[0]) for w, b in layers])

    def session_logits(self, context: torch.Tensor, context_mask: Optional[torch.Tensor],
                       frames: torch.Tensor, anchor: Optional[torch.Tensor] = None,
                       sample: bool = False) -> torch.Tensor:
        """``[S, Kt, C]``: each session's layers, generated from its context ``[S, Kc, D]``
        (``context_mask`` ``[S, Kc]``, True = padding), on the samples it scores ``frames``
        ``[S, Kt, D]``."""
        return apply_dynamic(self(context, context_mask), frames)

    @torch.no_grad()
    def swa_weights(self) -> list[list[float]]:
        """SWA's p (Eq. 8) of every dynamic layer, ``[N_p]`` each. p depends only on the
        generators' first-layer weights, not on the session: the same p serves every session."""
        return [[float(v) for v in gen.weights(self.temperature)] for gen in self.generators]


def weighted_session_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                        gamma: float = 1.0) -> torch.Tensor:
    """Cross-entropy over ``[S, K]`` session samples (padding skipped), the t-th weighted
    gamma^t, normalised by the weights."""
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    t = torch.arange(labels.shape[1], dtype=logits.dtype, device=logits.device)
    w = (gamma ** t).expand_as(labels) * (~mask).to(logits.dtype)
    return (ce * w.flatten()).sum() / w.sum().clamp_min(1e-12)


def dynamic_arrays(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The device's dynamic layers as named arrays: ``layer{n}.weight`` / ``layer{n}.bias``."""
    out = {}
    for n, (w, b) in enumerate(layers):
        out[f"layer{n}.weight"] = w.detach().cpu().contiguous()
        out[f"layer{n}.bias"] = b.detach().cpu().contiguous()
    return out


def dynamic_layers(arrays: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`dynamic_arrays` (what the device loads)."""
    n = len([k for k in arrays if k.endswith(".weight")])
    return [(arrays[f"layer{i}.weight"], arrays[f"layer{i}.bias"]) for i in range(n)]


def build_duet(cfg: DuetConfig, dim: int, num_classes: int) -> Duet:
    return Duet(dim, num_classes, hidden=list(cfg.dynamic_hidden), generators=cfg.generators,
                temperature=cfg.temperature, neck=cfg.neck, embed=cfg.embed,
                generator_hidden=cfg.generator_hidden)


class DynamicHead(nn.Module):
    """For the registry's counts: the PPG (trained on the server) and, as a module, one set of
    the dynamic layers a device receives."""

    def __init__(self, generator: nn.Module, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.generator = generator
        self.dynamic = nn.ModuleList(nn.Linear(i, o) for o, i in shapes)
        self.dynamic.requires_grad_(False)


class SessionPluginModel(AdaptedModel):
    """The registry's model of a session plug-in (used for its counts only): the generator
    trains on the server; what travels to a device is one set of dynamic layers."""

    def communicated_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters() if n.startswith("head.dynamic.")]


def registry_model(generator: nn.Module, shapes, backbone, with_backbone) -> SessionPluginModel:
    return SessionPluginModel(head=DynamicHead(generator, shapes),
                              backbone=backbone if with_backbone else None)


def session_counts(generator: nn.Module, shapes: list[tuple[int, int]]) -> dict:
    dynamic = sum(o * i + o for o, i in shapes)
    return {"generator_params": sum(p.numel() for p in generator.parameters()),
            "dynamic_params": dynamic, "download_bytes_per_session": 4 * dynamic}


@register_method("duet", DuetConfig, family="sessions",
                 counts=lambda cfg, d, c: _counts(cfg, d, c))
def build(cfg: DuetConfig, backbone, num_classes, with_backbone):
    _check(cfg)
    generator = build_duet(cfg, backbone.embed_dim, num_classes)
    return registry_model(generator, generator.shapes, backbone, with_backbone)


def _check(cfg: DuetConfig) -> None:
    check_session_plugin(cfg)
    for key in ("generators", "neck", "embed", "generator_hidden"):
        check(getattr(cfg, key) >= 1, f"method.{key}", getattr(cfg, key), "must be >= 1")
    check(all(h >= 1 for h in cfg.dynamic_hidden), "method.dynamic_hidden",
          list(cfg.dynamic_hidden), "widths >= 1")
    check(cfg.temperature > 0, "method.temperature", cfg.temperature, "must be > 0")
    check(0 < cfg.gamma <= 1, "method.gamma", cfg.gamma, "must be in (0, 1]")


def _counts(cfg: DuetConfig, dim: int, num_classes: int) -> dict:
    generator = build_duet(cfg, dim, num_classes)
    return {"generators": cfg.generators, "session": cfg.session,
            **session_counts(generator, generator.shapes)}
