"""CDC-MMPG (``cdc-mmpg.txt``): the Fast Domain Adaptor (FDA) generates one linear layer of the
device's model from its session; the AnchorFrame Distribution Reasoner (ADR) lets the device
upload ONE anchor feature instead of the session.

Inputs are sessions of K feature vectors ("frames"), optionally fused with a text-query feature
(``method.query``, encoded once by CLIP's text tower): fusion concatenates the query to every
frame (``[frame; query]``), so the device's frozen static part stays parameter-free and the same
code serves image sessions and multimodal ones.

FDA (Sec. 3.2): the session's frames averaged (v), projected by an MLP of two linear layers and a
LayerNorm (Eq. 5), then a hypernetwork MLP (Eq. 6) emits the weights and bias of one linear layer
``D -> C``, which the device applies to each frame (Eq. 7). Generated weights are scaled by
1/sqrt(D), as DUET's.

ADR (Sec. 3.3), this module's reading of the equations the text refers to:

- a VAE over the anchor feature a: ``enc(a) -> (mu, log sigma^2)``, ``z = mu + sigma * eps``
  (Eq. 8-9, 12), and a decoder (Eq. 10, 13) that outputs the reconstruction r of a and the
  session's channel-wise mean and std reasoned from it (mu_s^, sigma_s^);
- the adaptive generator re-normalises the anchor to a session's channel-wise statistics (AdaIN,
  Eq. 16): ``AG(a; mu, sigma) = (a - mu_pop) / sigma_pop * sigma + mu`` with the training
  features' channel-wise mean and std (mu_pop, sigma_pop) as the anchor's own;
- losses: beta * KL(q(z|a) || N(0, I)) + ||r - a||^2 (Eq. 14-15) plus the lambda-weighted terms
  between the generated feature g = AG(a; mu_s^, sigma_s^) and (i) the anchor re-normalised with
  the session's true statistics, (ii) the session's average v (Eq. 17-18). Every term is per
  anchor, summed over its dimensions (the KL over the latent's, the squared errors over the
  D features) and averaged over the anchors: the negative ELBO of a Gaussian decoder with fixed
  variance (up to constants), so the KL is weighed against a reconstruction of all D features
  rather than their mean (which let the KL win: the posterior collapsed to the prior and the
  decoder predicted the mean anchor). beta ramps linearly from 0 over the first
  ``method.kl_warmup`` epochs, then stays 1 (KL warm-up, Bowman et al. 2016);
- FDA then takes g in place of v (Eq. 11). Two stages with "the same adamw optimizer" (AdamW,
  ``method.weight_decay``): ADR first (2e-5, 10 epochs) with the paper's polynomial decay
  (``method.adr_schedule=polynomial``, the default: torch's PolynomialLR, power 1, from
  ``adr_lr`` to 0 over the ADR stage's steps; ``constant`` keeps the rate), then FDA with ADR
  frozen (1e-4, 40 epochs) at a constant rate.

Without ADR (``adr: false``) this is the paper's F-hyper ablation: the device uploads all K
frames and FDA takes their average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fedadapt.adapters.registry import register_method
from fedadapt.config import check
from fedadapt.methods.sessions.duet import (
    SessionPluginConfig,
    apply_dynamic,
    check_session_plugin,
    dynamic_arrays,
    masked_mean,
    registry_model,
    session_counts,
)


@dataclass
class CdcMmpgConfig(SessionPluginConfig):
    name: str = "cdc_mmpg"
    #: Sessions of 6 frames whose first 3 are the context (``context=first``): the paper's
    #: K = 3 sampled frames, which F-hyper uploads and among which CDC-MMPG's anchor is
    #: chosen; the other 3 are scored.
    session: int = 6
    context_size: int = 3
    #: FDA's hidden width (96 for QA, 256 for retrieval in the paper).
    hidden: int = 96
    #: ADR: the device uploads one anchor feature (false: F-hyper, all K frames, no generator).
    adr: bool = True
    latent: int = 64
    vae_hidden: int = 256
    #: lambda, the weight of ADR's extra terms.
    lam: float = 0.1
    #: Stage 1 (ADR): AdamW; stage 2 (FDA, ADR frozen) uses ``lr`` / ``max_epochs``. Both
    #: stages use AdamW with ``weight_decay`` ("the same adamw optimizer"; the paper gives no
    #: decay: 0.01 is AdamW's usual default).
    adr_lr: float = 2e-5
    adr_epochs: int = 10
    lr: float = 1e-4
    max_epochs: int = 40
    weight_decay: float = 0.01
    #: ADR's KL warm-up: its weight beta rises linearly from 0 over this many epochs, then
    #: stays 1 (epoch e from 1: min(1, (e - 1) / W) with W = min(kl_warmup, adr_epochs - 1), so
    #: the last epoch always trains the full objective); 0: beta = 1 throughout.
    kl_warmup: int = 5
    #: ADR's learning-rate schedule: ``polynomial`` (the paper's "adamw optimizer with a
    #: polynomial decay scheduler": torch's PolynomialLR, power 1, from ``adr_lr`` to 0 over
    #: the ``adr_epochs`` epochs' steps) or ``constant``.
    adr_schedule: str = "polynomial"
    #: A text query fused into every frame (e.g. a question about the session), encoded once
    #: by the backbone's text tower (a CLIP backbone); None: image sessions.
    query: Optional[str] = None

    def check(self) -> None:
        _check(self)


def fuse(frames: torch.Tensor, query: Optional[torch.Tensor]) -> torch.Tensor:
    """``[..., K, D]`` frames with a ``[..., Dq]`` query: ``[..., K, D + Dq]``."""
    if query is None:
        return frames
    return torch.cat([frames, query.unsqueeze(-2).expand(*frames.shape[:-1], -1)], dim=-1)


def channel_stats(frames: torch.Tensor, mask: Optional[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise mean and std over a session's frames (``[S, K, D]`` -> ``[S, D]`` each)."""
    mean = masked_mean(frames, mask)
    var = masked_mean((frames - mean.unsqueeze(-2)) ** 2, mask)
    return mean, (var + 1e-6).sqrt()


class Adr(nn.Module):
    """The anchor-frame VAE and the adaptive generator."""

    def __init__(self, dim: int, latent: int, hidden: int) -> None:
        super().__init__()
        self.dim = dim
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 3 * dim))
        # the training features' channel-wise statistics (set before training)
        self.register_buffer("pop_mean", torch.zeros(dim))
        self.register_buffer("pop_std", torch.ones(dim))

    def forward(self, anchor: torch.Tensor, sample: bool
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``anchor`` ``[S, D]`` -> the generated feature g ``[S, D]`` and the VAE's parts."""
        mu, logvar = self.encoder(anchor).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if sample else mu
        recon, s_mean, s_logstd = self.decoder(z).split(self.dim, dim=-1)
        g = self.renormalise(anchor, s_mean, s_logstd.exp())
        return g, {"mu": mu, "logvar": logvar, "recon": recon}

    def renormalise(self, anchor: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
                    ) -> torch.Tensor:
        """The adaptive generator (Eq. 16)."""
        return (anchor - self.pop_mean) / self.pop_std * std + mean

    def terms(self, anchor: torch.Tensor, frames: torch.Tensor, mask: Optional[torch.Tensor]
              ) -> dict[str, torch.Tensor]:
        """ADR's loss terms, each per anchor summed over its dimensions and averaged over the
        ``[S]`` anchors: ``kl`` (Eq. 14), ``recon`` (Eq. 15) and ``extra`` (Eq. 17), for
        anchors ``[S, D]`` and the sessions ``frames`` ``[S, K, D]`` they stand for."""
        g, vae = self(anchor, sample=True)
        kl = kl_per_dim(vae["mu"], vae["logvar"]).sum(-1)                      # [S]
        recon = ((vae["recon"] - anchor) ** 2).sum(-1)                          # [S]
        mean, std = channel_stats(frames, mask)                                 # [S, D] each
        target = self.renormalise(anchor, mean, std)
        extra = ((g - target) ** 2).sum(-1) + ((g - mean) ** 2).sum(-1)         # [S]
        return {"kl": kl.mean(), "recon": recon.mean(), "extra": extra.mean()}

    def loss(self, anchor: torch.Tensor, frames: torch.Tensor, mask: Optional[torch.Tensor],
             lam: float, beta: float = 1.0) -> torch.Tensor:
        """beta * KL + reconstruction + lambda * the extra terms (Eq. 18's ADR part)."""
        t = self.terms(anchor, frames, mask)
        return beta * t["kl"] + t["recon"] + lam * t["extra"]

    @torch.no_grad()
    def diagnostics(self, anchors: torch.Tensor) -> dict[str, float]:
        """Whether the VAE uses its latent, on anchors ``[N, D]`` (z = mu): the reconstruction's
        MSE per feature against predicting the training features' mean, the KL per anchor (nats,
        summed over the latent), the latent dimensions whose mean KL exceeds 0.01 nats
        ("active"), and mu's standard deviation across the anchors (mean over dimensions)."""
        mu, logvar = self.encoder(anchors).chunk(2, dim=-1)                     # [N, L] each
        recon = self.decoder(mu)[..., :self.dim]                                # [N, D]
        kl = kl_per_dim(mu, logvar).mean(0)                                     # [L]
        return {"recon_mse": float(((recon - anchors) ** 2).mean()),
                "mean_predictor_mse": float(((anchors - self.pop_mean) ** 2).mean()),
                "kl": float(kl.sum()), "active_dims": int((kl > 0.01).sum()),
                "latent_dims": int(kl.numel()),
                "mu_std": float(mu.std(0).mean()) if len(mu) > 1 else 0.0}


def kl_per_dim(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, sigma^2) || N(0, 1)) per latent dimension, ``[..., L]`` (Eq. 14)."""
    return -0.5 * (1 + logvar - mu ** 2 - logvar.exp())


class CdcMmpg(nn.Module):
    """FDA (with ADR unless ``adr=False``): a session -> one linear layer ``D -> C``."""

    def __init__(self, dim: int, num_classes: int, *, hidden: int, adr: bool, latent: int,
                 vae_hidden: int, query_dim: int = 0) -> None:
        super().__init__()
        self.in_dim = dim + query_dim
        self.num_classes = num_classes
        self.shapes = [(num_classes, self.in_dim)]
        self.project = nn.Sequential(nn.Linear(self.in_dim, hidden), nn.LayerNorm(hidden),
                                     nn.Linear(hidden, hidden))            # Eq. 5
        self.hyper = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(),
                                   nn.Linear(hidden, num_classes * self.in_dim + num_classes))
        self.adr = Adr(self.in_dim, latent, vae_hidden) if adr else None

    def generate_layer(self, summary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FDA: ``[S, D]`` (v, or ADR's g) -> weights ``[S, C, D]`` and bias ``[S, C]``."""
        flat = self.hyper(self.project(summary))                            # Eq. 6
        c, d = self.num_classes, self.in_dim
        return flat[:, :c * d].reshape(-1, c, d) / math.sqrt(d), flat[:, c * d:]

    def summary(self, frames: torch.Tensor, mask: Optional[torch.Tensor],
                anchor: Optional[torch.Tensor], sample: bool = False) -> torch.Tensor:
        if self.adr is None:
            return masked_mean(frames, mask)                               # v
        return self.adr(anchor, sample)[0]                                 # g (Eq. 11)

    # -- the plug-in interface (fedadapt.methods.sessions.train) ----------------------------
    def generate(self, upload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.adr is None:
            summary = upload["embeddings"].mean(0, keepdim=True)
        else:
            summary = self.adr(upload["anchor"], sample=False)[0]
        w, b = self.generate_layer(summary)
        return dynamic_arrays([(w[0], b[0])])

    def session_logits(self, context: torch.Tensor, context_mask: Optional[torch.Tensor],
                       frames: torch.Tensor, anchor: Optional[torch.Tensor] = None,
                       sample: bool = False) -> torch.Tensor:
        """``[S, Kt, C]``: each session's layer, generated from its context ``[S, Kc, D]`` (F-hyper:
        their average) or from the anchor ``[S, D]`` chosen among them (ADR; its latent is
        sampled in training), on the frames it scores ``[S, Kt, D]`` (Eq. 7)."""
        layer = self.generate_layer(self.summary(context, context_mask, anchor, sample))
        return apply_dynamic([layer], frames)


def build_cdc_mmpg(cfg: CdcMmpgConfig, dim: int, num_classes: int, query_dim: int = 0
                   ) -> CdcMmpg:
    return CdcMmpg(dim, num_classes, hidden=cfg.hidden, adr=cfg.adr, latent=cfg.latent,
                   vae_hidden=cfg.vae_hidden, query_dim=query_dim)


def query_width(cfg: CdcMmpgConfig, embed_dim: int) -> int:
    """CLIP's text features share the image features' joint space (width ``embed_dim``)."""
    return embed_dim if cfg.query else 0


def _check(cfg: CdcMmpgConfig) -> None:
    check_session_plugin(cfg)
    for key in ("hidden", "latent", "vae_hidden", "adr_epochs"):
        check(getattr(cfg, key) >= 1, f"method.{key}", getattr(cfg, key), "must be >= 1")
    check(cfg.adr_lr > 0, "method.adr_lr", cfg.adr_lr, "must be > 0")
    check(cfg.lam >= 0, "method.lam", cfg.lam, "must be >= 0")
    check(cfg.kl_warmup >= 0, "method.kl_warmup", cfg.kl_warmup, "must be >= 0 (epochs)")
    check(cfg.adr_schedule in ("polynomial", "constant"), "method.adr_schedule",
          cfg.adr_schedule, "must be polynomial or constant")
    check(cfg.query is None or cfg.query.strip() != "", "method.query", cfg.query,
          "a text, or null for image sessions")


@register_method("cdc_mmpg", CdcMmpgConfig, family="sessions",
                 counts=lambda cfg, d, c: _counts(cfg, d, c))
def build(cfg: CdcMmpgConfig, backbone, num_classes, with_backbone):
    _check(cfg)
    generator = build_cdc_mmpg(cfg, backbone.embed_dim, num_classes,
                               query_width(cfg, backbone.embed_dim))
    return registry_model(generator, generator.shapes, backbone, with_backbone)


def _counts(cfg: CdcMmpgConfig, dim: int, num_classes: int) -> dict:
    generator = build_cdc_mmpg(cfg, dim, num_classes, query_width(cfg, dim))
    adr = 0 if generator.adr is None else sum(p.numel() for p in generator.adr.parameters())
    return {"adr": cfg.adr, "session": cfg.session, "adr_params": adr,
            **session_counts(generator, generator.shapes)}
