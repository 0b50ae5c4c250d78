"""fedadapt-budget: per-exit FLOPs, parameters, peak training memory and step time (the
Accumulator paper's Table 7) on a tiny random ViT, and the CPU live-memory tracker itself."""

import json

import pytest
import torch

from fedadapt.budget import MB, _main, measure_exit_budget
from fedadapt.config import ConfigError
from fedadapt.entry import compose_config, to_run_config
from fedadapt.measure import LiveMemoryTracker

KEYS = {"exit", "params", "flops", "peak_mb_frozen", "peak_mb_full", "step_ms_frozen",
        "step_ms_full"}
TINY = ["backbone=tiny_vit", "backbone.arch.num_hidden_layers=3", "dataset=digits"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared, busy CPU are far faster (and steadier) on one thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def tiny(method: str, *extra: str):
    return to_run_config(compose_config([f"method={method}", *TINY, *extra]))


@pytest.fixture(scope="module")
def rows():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {m: measure_exit_budget(tiny(m), repeats=1) for m in ("accumulator", "lw_linear")}
    torch.set_num_threads(saved)


def allocator_peak_bytes(fn, *args) -> int:
    """Peak of bytes allocated (and not yet freed) during ``fn(*args)`` by the CPU allocator,
    from torch.profiler's memory events (allocation > 0, free < 0, in time order)."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn(*args)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


# -- the tracker ------------------------------------------------------------------------------

def test_tracker_counts_frees_and_shared_storage_once():
    with LiveMemoryTracker() as tr:
        a = torch.empty(MB)  # float32: 4 MB
        assert tr.live_bytes == 4 * MB
        views = [a.view(-1, 2), a[::2], a.unsqueeze(0), a.add_(1)]
        assert tr.live_bytes == 4 * MB  # views and in-place results share the storage
        del a, views
        assert tr.live_bytes == 0
        b = torch.ones(MB // 2)  # 2 MB
        assert tr.live_bytes == 2 * MB
    assert tr.peak_bytes == 4 * MB  # 4 MB then 2 MB: the peak is 4 MB, not 6 MB
    del b
    assert tr.live_bytes == 0


def test_tracker_baseline_and_backward():
    lin = torch.nn.Linear(256, 256)  # 257 KiB of parameters
    x = torch.randn(64, 256)
    tr = LiveMemoryTracker([*lin.parameters(), x, None])
    assert tr.baseline_bytes == tr.peak_bytes == (256 * 256 + 256 + 64 * 256) * 4
    with tr:
        lin(x).square().sum().backward()
    grads = (256 * 256 + 256) * 4
    assert tr.live_bytes == tr.baseline_bytes + grads  # the gradients outlive the step
    assert tr.peak_bytes >= tr.baseline_bytes + grads + 64 * 256 * 4  # plus the activations
    lin.zero_grad(set_to_none=True)
    assert tr.live_bytes == tr.baseline_bytes  # freeing the gradients is observed too


def test_tracker_agrees_with_the_cpu_allocator():
    """On a real training step of the budget's own code, the tracker's peak of new bytes is the
    allocator's (the tracker misses only scratch memory allocated inside single kernels)."""
    from fedadapt.adapters import build_model
    from fedadapt.backbones import build_backbone
    from fedadapt.budget import _baseline_tensors, _step, _tier_model
    from fedadapt.federation.client.training import make_optimizer

    run = tiny("accumulator", "method.head_hidden=[64]")
    base = build_model(run.method, build_backbone(run.backbone, load_weights=False), 10,
                       with_backbone=True)
    for full in (False, True):
        model = _tier_model(base, 2, full)
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], run.train, 0.01)
        x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
        _step(model, opt, x, y, 2)
        opt.zero_grad(set_to_none=True)
        tr = LiveMemoryTracker(_baseline_tensors(model, opt, (x, y)))
        with tr:
            _step(model, opt, x, y, 2)
        opt.zero_grad(set_to_none=True)
        allocator = allocator_peak_bytes(_step, model, opt, x, y, 2)
        tracked = tr.peak_bytes - tr.baseline_bytes
        assert 0.9 * allocator <= tracked <= allocator, (full, tracked, allocator)


# -- the rows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["accumulator", "lw_linear"])
@pytest.mark.slow
def test_rows_grow_with_the_exit_and_frozen_is_cheaper(rows, method):
    out = rows[method]
    assert [r["exit"] for r in out] == [0, 1, 2]
    for r in out:
        assert KEYS <= set(r)
        assert r["peak_mb_frozen"] < r["peak_mb_full"]
        assert r["step_ms_frozen"] > 0 and r["step_ms_full"] > 0
        assert r["trainable_params_frozen"] < r["model_params"]
    for a, b in zip(out, out[1:]):
        assert a["params"] < b["params"] and a["flops"] < b["flops"]
        assert a["peak_mb_full"] < b["peak_mb_full"]
        assert a["peak_mb_frozen"] < b["peak_mb_frozen"]
    # one tiny_vit block: qkv + output (4 x (32*32 + 32)), MLP (32*64 + 64 + 64*32 + 32), 2 LNs
    assert out[1]["params"] - out[0]["params"] == 4 * 1056 + 4192 + 128
    # the weights alone (fp32) are a lower bound of the full step's peak
    assert all(r["peak_mb_full"] * MB > 4 * r["model_params"] for r in out)


def test_bad_exit_backbone_or_device_is_a_config_error():
    with pytest.raises(ConfigError, match="--exits"):
        measure_exit_budget(tiny("lw_linear"), exits=[3])
    with pytest.raises(ConfigError, match="--exits"):
        measure_exit_budget(tiny("lw_linear"), exits=[-1])
    with pytest.raises(ConfigError, match="no early exits"):
        measure_exit_budget(to_run_config(compose_config(
            ["method=linear_head", "backbone=small_cnn", "dataset=digits"])))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            measure_exit_budget(tiny("lw_linear"), device="cuda")


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "budget.json"
    assert _main(["--exits", "0,2", "--repeats", "1", "--out", str(out),
                  "method=lw_linear", *TINY]) == 0
    printed = capsys.readouterr()
    assert "| exit | FLOPs (G) | params (M) | peak MB full |" in printed.out
    assert printed.out.count("\n| 0 |") == 1 and printed.out.count("\n| 2 |") == 1
    assert "[budget] exit 2/2" in printed.err
    saved = json.loads(out.read_text())
    assert saved["method"] == "lw_linear" and [r["exit"] for r in saved["rows"]] == [0, 2]
    with pytest.raises(ConfigError, match="--exits"):
        _main(["--exits", "0,x", "method=lw_linear", *TINY])
