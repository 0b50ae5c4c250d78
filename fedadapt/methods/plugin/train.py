"""Server-trained plug-ins (ICIIA): trained once on the server ("cloud") from the training clients'
cached features, then delivered to every client as named arrays in one Flower round; the clients
only recognise with it.

ICIIA's Algorithm 1 on the server:

1. the *original model*: the backbone's classifier ``Linear(D, C)`` trained on the mixture of all
   clients' training features (early stopping on their validation features);
2. the module, its classifier initialised from the original one, trained on sequences of B
   images that each come from ONE client (SGD, gradient-norm clipping, early stopping on the
   clients' validation sequences; the best validation epoch is kept);
3. the prompt-tuning baseline: the classifier over ``[feature; client token]`` with one learned
   token of D/2 per client, trained jointly on the clients' labeled training features.

Each client then recognises its test split (in arrival order) with the original classifier, with
the module in batch mode (sequences of B of its images), one by one with its cache of the B - 1
most recent features (the original classifier answers while the cache holds fewer than
``method.min_history``: cold start), with its prompt token, and with the last layer fine-tuned on
its own labeled training split (the fine-tuning baseline, trained on the client).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.federation.client.training import RunSpec, derive_seed
from fedadapt.methods.plugin.iciia import Iciia, recognize_stream
from fedadapt.methods.server_trained import (
    CLASSIFIER_BATCH,
    ServerData,
    accuracy,
    accuracy_over_clients,
    fit,
    pad,
    pad_labels,
    sequences,
    train_original,
)


def build_module(spec: RunSpec) -> Iciia:
    m = spec.method
    return Iciia(spec.embed_dim, spec.num_classes, layers=m.layers, groups=m.groups,
                 heads=m.heads, dropout=m.dropout, mixing=m.mixing, shuffle=m.shuffle,
                 classifier_relu=m.classifier_relu)


class PromptClassifier(nn.Module):
    """Prompt tuning for a frozen feature extractor: ``Linear(D + D/2, C)`` over the feature and
    the client's learned token (one token of D/2 per client)."""

    def __init__(self, dim: int, num_classes: int, num_clients: int) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.zeros(num_clients, dim // 2))
        self.linear = nn.Linear(dim + dim // 2, num_classes)

    def forward(self, feats: torch.Tensor, client: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([feats, self.tokens[client]], dim=-1))


def train_on_server(spec: RunSpec) -> dict:
    """Algorithm 1 and the baselines' server parts; returns the trained modules and a log."""
    m = spec.method

    def stage_rng(stage: int) -> np.random.Generator:
        """Each stage draws from its own seeded streams, so the baselines are the same in every
        run of a seed, whichever module is trained between them."""
        torch.manual_seed(derive_seed(spec.seed, 0x1C11A, stage))
        return np.random.default_rng([spec.seed, 0x1C11A, stage])

    data = ServerData.of(spec)
    feats, labels, clients = data.feats, data.labels, data.clients
    train_idx, val_idx, owner = data.train_idx, data.val_idx, data.owner

    # 1. the original model: the classifier on the mixture of the clients' training features
    original, original_log = train_original(spec, data, stage_rng(1), lr=m.lr)

    # 2. ICIIA: sequences of B images of one client, the classifier starts from the original
    rng = stage_rng(2)
    module = build_module(spec)
    module.classifier.load_state_dict(original.state_dict())
    val_seqs = [s for c in clients for s in sequences(c.val, m.images, rng)]

    def iciia_batches():
        seqs = [s for c in clients for s in sequences(c.train, m.images, rng)]
        order = rng.permutation(len(seqs))
        for i in range(0, len(order), m.sequences_per_step):
            group = [seqs[j] for j in order[i:i + m.sequences_per_step]]
            x, mask = pad([feats[s] for s in group], m.images)
            y = pad_labels([labels[s] for s in group], m.images)
            logits = module(x, mask)
            yield F.cross_entropy(logits[~mask], y[~mask])

    @torch.no_grad()
    def iciia_val() -> float:
        correct = total = 0
        for s in val_seqs:
            correct += int((module(feats[s]).argmax(-1) == labels[s]).sum())
            total += len(s)
        return correct / max(total, 1)

    iciia_log = fit(module, iciia_batches, iciia_val, epochs=m.max_epochs, patience=m.patience,
                    lr=m.lr, momentum=m.momentum, weight_decay=m.weight_decay, clip=m.clip,
                    label=f"{m.name} (ICIIA)")

    # 3. prompt tuning: one token per client, trained with the classifier
    prompt = None
    prompt_log = None
    if m.prompt_tuning:
        rng = stage_rng(3)
        prompt = PromptClassifier(spec.embed_dim, spec.num_classes, len(clients))
        owner_t = torch.from_numpy(owner)

        def prompt_batches():
            for b in sequences(train_idx, CLASSIFIER_BATCH, rng):
                yield F.cross_entropy(prompt(feats[b], owner_t[b]), labels[b])

        @torch.no_grad()
        def prompt_val() -> float:
            return accuracy(prompt(feats[val_idx], owner_t[val_idx]), labels[val_idx])

        prompt_log = fit(prompt, prompt_batches, prompt_val, epochs=m.classifier_epochs,
                         patience=m.patience, lr=m.lr, momentum=m.momentum,
                         weight_decay=m.weight_decay, label="prompt tuning")
    return {"original": original.eval(), "module": module.eval(),
            "prompt": None if prompt is None else prompt.eval(),
            "log": {"original": original_log, "iciia": iciia_log, "prompt": prompt_log}}


def client_arrays(trained: dict, cid: int) -> dict[str, torch.Tensor]:
    """What client ``cid`` receives: the module (with its classifier), the original classifier
    and, for prompt tuning, the shared classifier and ITS token only."""
    out = {f"iciia.{k}": v for k, v in trained["module"].state_dict().items()}
    out.update({f"original.{k}": v for k, v in trained["original"].state_dict().items()})
    if trained["prompt"] is not None:
        p = trained["prompt"]
        out.update({f"prompt.linear.{k}": v for k, v in p.linear.state_dict().items()})
        out["prompt.token"] = p.tokens[cid].detach().clone()
    return {k: v.detach().cpu().clone() for k, v in out.items()}


@torch.no_grad()
def recognize(spec: RunSpec, cid: int, arrays: dict[str, torch.Tensor]) -> dict:
    """The client's side: recognise its test split with what it received (no training, except
    the fine-tuning baseline's last layer on its own labeled training split)."""
    m = spec.method
    module = build_module(spec)
    module.load_state_dict({k[6:]: v for k, v in arrays.items() if k.startswith("iciia.")})
    module.eval()
    original = nn.Linear(spec.embed_dim, spec.num_classes)
    original.load_state_dict({k[9:]: v for k, v in arrays.items() if k.startswith("original.")})
    split = spec.clients[cid]
    # the order the images arrive in: a seeded permutation (stored order may be class-sorted)
    order = np.random.default_rng([spec.seed, 0xA77, cid]).permutation(split.test)
    x, y = spec.train_source.get(order)
    out = {"num-examples": len(y), "acc_original": accuracy(original(x), y)}
    batch_logits = [module(x[i:i + m.images]) for i in range(0, len(y), m.images)]
    out["acc_batch"] = accuracy(torch.cat(batch_logits), y) if len(y) else float("nan")
    stream = recognize_stream(module, original, x, m.images - 1, m.min_history) if len(y) \
        else torch.empty(0, spec.num_classes)
    out["acc_stream"] = accuracy(stream, y)
    for h in m.history_sweep:  # Figure 6: exactly h cached features per recognised image
        if len(y) > h:
            logits = recognize_stream(module, original, x, h, h)[h:]
            out[f"acc_h{h}"] = accuracy(logits, y[h:])
            out[f"n_h{h}"] = len(y) - h
    seen = len(split.train) > 0  # unseen test clients ("by client"): no labels, no tuning
    if "prompt.token" in arrays and seen:
        linear = nn.Linear(spec.embed_dim + spec.embed_dim // 2, spec.num_classes)
        linear.load_state_dict({k[14:]: v for k, v in arrays.items()
                                if k.startswith("prompt.linear.")})
        token = arrays["prompt.token"].expand(len(y), -1)
        out["acc_prompt"] = accuracy(linear(torch.cat([x, token], dim=-1)), y)
    out["acc_finetune"] = _finetune_last_layer(spec, cid, original, x, y) if seen \
        else float("nan")
    return out


def _finetune_last_layer(spec: RunSpec, cid: int, original: nn.Linear, x_test, y_test) -> float:
    """The fine-tuning baseline as the authors run it (mikudehuane/ICIIA, ``code/finetune.py``):
    the original classifier trained on the client's labeled training split, SGD
    (``method.lr``, ``method.momentum``), batches of ``method.finetune_batch``, gradient-norm
    clipping ``method.clip``; evaluated on the client's validation split before every epoch
    (epoch 0: the original classifier), stopped after ``method.patience`` epochs without gain,
    at most ``method.finetune_epochs``; returns the test accuracy of the best validation epoch
    (the last epoch's when the client has no validation split)."""
    m = spec.method
    if m.finetune_epochs == 0:
        return float("nan")
    split = spec.clients[cid]
    layer = copy.deepcopy(original)
    xs, ys = spec.train_source.get(split.train)
    xv, yv = spec.train_source.get(split.val) if len(split.val) else (None, None)
    gen = torch.Generator().manual_seed(derive_seed(spec.seed, 0xF1, cid))
    opt = torch.optim.SGD(layer.parameters(), lr=m.lr, momentum=m.momentum)
    best_val, best_test, waited = float("-inf"), float("nan"), 0
    for epoch in range(m.finetune_epochs + 1):  # evaluate, then train (none after the last)
        if xv is not None:  # early stopping on the client's own validation split
            val = accuracy(layer(xv), yv)
            if val > best_val:
                best_val, best_test, waited = val, accuracy(layer(x_test), y_test), 0
            elif (waited := waited + 1) >= m.patience:
                break
        if epoch < m.finetune_epochs:
            _sgd_epoch(layer, opt, xs, ys, m.finetune_batch, m.clip, gen)
    return best_test if xv is not None else accuracy(layer(x_test), y_test)


def _sgd_epoch(layer: nn.Module, opt: torch.optim.Optimizer, xs: torch.Tensor, ys: torch.Tensor,
               batch: int, clip: float, gen: torch.Generator) -> None:
    """One epoch of shuffled mini-batches with gradient-norm clipping."""
    perm = torch.randperm(len(ys), generator=gen)
    with torch.enable_grad():
        for i in range(0, len(ys), batch):
            b = perm[i:i + batch]
            loss = F.cross_entropy(layer(xs[b]), ys[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(layer.parameters(), clip)
            opt.step()


RESULT_KEYS = ("acc_original", "acc_finetune", "acc_prompt", "acc_batch", "acc_stream")


def summarize_recognition(rows: list[dict]) -> dict:
    """Per metric: the accuracy over all clients' test images (example-weighted, Table 4) and
    the mean over clients."""
    history = sorted({k for r in rows for k in r if k.startswith("acc_h")},
                     key=lambda k: int(k[5:]))
    out = {key: accuracy_over_clients(rows, key) for key in RESULT_KEYS}
    out.update({key: accuracy_over_clients(rows, key, "n_h" + key[5:]) for key in history})
    return {k: v for k, v in out.items() if v is not None}
