"""The job's time estimate, shown beside its progress display (:class:`fedadapt.progress.Job`):
each method's seconds per round, from the rounds a resumed run did already or, for a method that
runs the backbone every round on the CPU, from a timed step of the backbone."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def method_costs(jobs, prepared: dict, dirs: dict[str, Path]
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """Each method's seconds per round for the job's estimate (:class:`fedadapt.progress.Job`):
    ``measured``, the median ``round_s`` of the rounds a resumed run did already; ``extra``,
    for a method that runs the backbone every round (no cached features) on the CPU, the
    backbone's share of a round (:func:`backbone_seconds_per_round`) from a timed step."""
    import statistics

    from fedadapt.devices import run_device
    from fedadapt.results.store import read_jsonl

    measured, extra, timed = {}, {}, {}
    for name, run, _ in jobs:
        done = [r["round_s"] for r in (read_jsonl(dirs[name] / "metrics.jsonl")
                                       if (dirs[name] / "metrics.jsonl").is_file() else [])
                if r.get("round_s")]
        if done:
            measured[name] = statistics.median(done)
            continue
        prep = prepared.get(name)
        backbone = getattr(getattr(prep, "model", None), "backbone", None)
        if backbone is None or getattr(run.method, "use_cache", False) \
                or run_device(run.federation.num_gpus) != "cpu":  # the driver's CPU says
            continue  # nothing of a GPU's time
        trains = any(p.requires_grad for p in backbone.parameters())
        key = (run.backbone.name, backbone.image_size, trains)
        if key not in timed:
            timed[key] = timed_backbone(backbone, trains)
        if timed[key] is not None:
            extra[name] = backbone_seconds_per_round(run, prep, *timed[key])
    return measured, extra


def timed_backbone(backbone, trains: bool) -> Optional[tuple[float, float]]:
    """Seconds per image of the backbone in a training step (forward and backward where the
    method trains it, on a copy: the run's model is left as it was) and in evaluation (a
    forward without gradients); None where it cannot be timed (an estimate never stops a job)."""
    import copy
    import time

    import torch

    def seconds(step, x) -> float:
        step(x)  # warm-up
        t0 = time.perf_counter()
        step(x)
        return (time.perf_counter() - t0) / len(x)

    def evaluate(x):
        with torch.no_grad():
            model(x)

    def train(x):
        out = model(x)
        (out if torch.is_tensor(out) else out[0]).float().sum().backward()

    try:
        model = copy.deepcopy(backbone).eval()  # batch-norm statistics stay the run's
        x = backbone.example_input(8)
        per_eval = seconds(evaluate, x)
        if not trains:
            return per_eval, per_eval
        model.train()
        return seconds(train, x), per_eval
    except Exception:  # noqa: BLE001 - an estimate never stops a job: no estimate
        return None


def backbone_seconds_per_round(run, prep, per_train: float, per_eval: float) -> float:
    """A round's backbone time where the features are not cached: the clients' training (a
    step's time per image and epoch, over the workers) and, each ``federation.eval_every``
    rounds, the forwards of the evaluation (the global test split on the server, the sampled
    clients' test splits)."""
    clients = prep.partition.clients
    train = sum(len(c.train) for c in clients) * run.partition.fraction_fit \
        * run.train.local_epochs
    workers = max(1, int((prep.layout or {}).get("workers") or 1))
    test = prep.spec.test_source
    evaluated = (len(test.labels()) if test is not None else 0) \
        + sum(len(c.test) for c in clients) * run.partition.fraction_evaluate / workers
    return per_train * train / workers + per_eval * evaluated / run.federation.eval_every

