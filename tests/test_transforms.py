"""The device data path: decoded image store, batched transforms against their references,
seeded crops and corruptions independent of batch composition, prefetching streams, precision.

Stated tolerances: the evaluation resize + crop + byte rounding agrees with torchvision's PIL
pipeline, open_clip's and transformers' preprocessing to at most 2/255 per value, and to 1/255 in
all but 1e-4 of the values (PIL resamples bytes in fixed point: measured, bicubic is exact in
99.9% of the values, bilinear in 91-99.9%); the training crop agrees with torchvision's tensor
``resized_crop`` on the same box to 1e-5.
"""

import dataclasses

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from conftest import tiny_run
from PIL import Image

from fedadapt.adapters.heads import LinearHeadConfig
from fedadapt.config import ConfigError, DatasetConfig
from fedadapt.data.transforms import (
    Preprocess,
    crop_boxes,
    hash_uniform,
    resample_boxes,
    to_float,
)
from fedadapt.experiment import prepare_run

BYTE = 1 / 255 + 1e-6


def plain(size, resize, interpolation="bicubic"):
    return Preprocess(size=size, resize=resize, interpolation=interpolation,
                      mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def pil_reference(img: np.ndarray, size: int, resize: int, mode) -> torch.Tensor:
    pil = Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).convert("RGB")
    return T.Compose([T.Resize(resize, interpolation=mode), T.CenterCrop(size),
                      T.ToTensor()])(pil)


@pytest.mark.parametrize("shape", [(28, 28, 1), (32, 32, 3), (37, 29, 3), (29, 50, 3)])
@pytest.mark.parametrize("size,resize", [(224, 256), (24, 27), (16, 16)])
@pytest.mark.parametrize("interp", ["bicubic", "bilinear"])
def test_eval_resize_matches_torchvision_pil(shape, size, resize, interp):
    img = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    mode = T.InterpolationMode.BICUBIC if interp == "bicubic" else T.InterpolationMode.BILINEAR
    ref = pil_reference(img, size, resize, mode)
    out = plain(size, resize, interp).apply(torch.from_numpy(img)[None])[0]
    assert out.shape == ref.shape == (3, size, size)
    diff = (out - ref).abs()
    assert diff.max() <= 2 * BYTE and (diff > BYTE).float().mean() <= 1e-4


def test_clip_preprocess_matches_open_clip():
    import open_clip
    from conftest import TINY_CLIP

    from fedadapt.backbones import build_backbone

    b = build_backbone(TINY_CLIP)
    assert b.interpolation == "bicubic" and b.crop_pct == 1.0
    img = np.random.default_rng(1).integers(0, 256, (45, 60, 3), dtype=np.uint8)
    ref = open_clip.image_transform(b.image_size, is_train=False, mean=b.mean, std=b.std)(
        Image.fromarray(img))
    out = Preprocess.for_backbone(b).apply(torch.from_numpy(img)[None])[0]
    std = torch.tensor(b.std).view(3, 1, 1)
    assert ((out - ref) * std).abs().max() <= BYTE  # compare in [0, 1] units


def test_deit_preprocess_matches_its_image_processor(tmp_path):
    """A ViT saved with DeiT's image processor (bicubic 256, centre crop 224) loads that
    preprocessing, and it agrees with the processor's own output."""
    from transformers import DeiTImageProcessor, ViTConfig, ViTModel

    from fedadapt.backbones import build_backbone
    from fedadapt.config import BackboneConfig

    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, patch_size=16, image_size=224),
             add_pooling_layer=False).save_pretrained(tmp_path)
    processor = DeiTImageProcessor(size={"height": 256, "width": 256}, resample=3,
                                   crop_size={"height": 224, "width": 224})
    processor.save_pretrained(tmp_path)
    b = build_backbone(BackboneConfig(name="deit", family="vit", weights=str(tmp_path)))
    assert b.interpolation == "bicubic" and b.crop_pct == pytest.approx(224 / 256)
    img = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    ref = processor(Image.fromarray(img), return_tensors="pt")["pixel_values"][0]
    out = Preprocess.for_backbone(b).apply(torch.from_numpy(img)[None])[0]
    std = torch.tensor(b.std).view(3, 1, 1)
    assert ((out - ref) * std).abs().max() <= 2 * BYTE  # transformers rescales in float32


def test_training_crop_matches_torchvision_resized_crop():
    x = to_float(torch.from_numpy(np.random.default_rng(3).integers(
        0, 256, (2, 40, 30, 3), dtype=np.uint8)))
    boxes = torch.tensor([[3, 5, 20, 17], [0, 0, 40, 30]])
    for size in (64, 12):  # up and down
        out = resample_boxes(x, boxes, size)
        for i, (top, left, h, w) in enumerate(boxes.tolist()):
            ref = TF.resized_crop(x[i], top, left, h, w, [size, size], antialias=True)
            torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=0)


def test_crop_boxes_follow_torchvision_and_ignore_batch_composition():
    idx = np.arange(2000)
    boxes = crop_boxes(32, 32, (0.05, 1.0), np.full(len(idx), 11, np.uint64), idx)
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 32).all() and \
        (left + w <= 32).all()
    area = h * w / 1024
    assert area.min() >= 0.04 and area.max() <= 1.0 and 0.4 < area.mean() < 0.6
    # the same image under the same seed gets the same box in any batch, in any position
    picked = np.array([1999, 5, 700])
    again = crop_boxes(32, 32, (0.05, 1.0), np.full(3, 11, np.uint64), picked)
    np.testing.assert_array_equal(again, boxes[picked])
    mixed = crop_boxes(32, 32, (0.05, 1.0), np.array([11, 12, 11], np.uint64), picked)
    np.testing.assert_array_equal(mixed[[0, 2]], boxes[picked[[0, 2]]])
    assert not np.array_equal(mixed[1], boxes[5])
    u = hash_uniform(np.full(5000, 3, np.uint64), np.arange(5000), 2)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.02


def test_store_decodes_once_at_native_size_and_is_sealed(cache_dir):
    from fedadapt.data import integrity

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig(use_cache=False)), quiet=True)
    src = prep.spec.train_source
    arr = src.store.array()
    assert arr.dtype == np.uint8 and arr.shape == (src.prepared.num_train, 8, 8, 1)  # digits
    raw = np.asarray(src.prepared.load()["train"][3]["image"].convert("L"))
    np.testing.assert_array_equal(arr[3, :, :, 0], raw)
    assert integrity.problem(src.store.path) is None
    # one pass through the stream gives the same batches as one-by-one, in order
    batches = [np.array([5, 1, 9]), np.array([0]), np.array([7, 7])]
    got = list(src.stream(batches, "cpu"))
    for b, (x, y) in zip(batches, got):
        x1, y1 = src.get(b)
        assert torch.equal(x, x1) and torch.equal(y, y1)
        assert torch.equal(y, torch.from_numpy(src.labels()[b]))


@pytest.mark.parametrize("shape,size,resize", [
    ((28, 28, 1), 32, 32),   # Fashion-MNIST into a small CNN: upsampled, grey kept
    ((37, 29, 3), 24, 27),   # shrunk on both sides, then cropped
    ((16, 16, 3), 16, 16),   # nothing to resize
])
def test_resized_bytes_then_normalised_is_the_per_batch_input_to_the_bit(shape, size, resize):
    pre = Preprocess(size=size, resize=resize, interpolation="bilinear",
                     mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.25))
    images = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (6, *shape), np.uint8))
    stored = pre.resized_bytes(images)
    assert stored.dtype == torch.uint8 and stored.shape == (6, size, size, shape[-1])
    assert torch.equal(pre.normalize(to_float(stored)), pre.apply(images))


def test_a_source_keeps_its_images_at_the_input_size_and_streams_the_per_batch_input(
        cache_dir, monkeypatch):
    from fedadapt.data import integrity, sources, store

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig(use_cache=False)), quiet=True)
    src = prep.spec.train_source  # digits' 8 px stored, the tiny CNN's 16 px input
    assert src.inputs.shape == (src.store.shape[0], 16, 16, 1)
    batches = [np.array([5, 1, 9]), np.array([1, 0]), np.array([9, 9, 2])]
    expected = [src.preprocess.apply(torch.from_numpy(src.store.array()[b])) for b in batches]
    sources.input_rows(src, batches[0])  # the first batch builds it
    assert integrity.problem(src.inputs.path) is None  # sealed, beside the store
    monkeypatch.setattr(Preprocess, "resized_bytes", None)  # nothing resized while streaming
    for b, want, (x, y) in zip(batches, expected, src.stream(batches, "cpu")):
        assert torch.equal(x, want)
        assert torch.equal(y, torch.from_numpy(src.labels()[b]))
    # corrupted rows are resized per batch; a store at the input size, or too big, has none
    assert sources.input_rows(src.corrupted("gaussian_noise", 3, seed=0), batches[0]) is None
    monkeypatch.undo()
    square = dataclasses.replace(src.preprocess, size=8, resize=8)
    assert store.input_store(src.store, square) is None
    monkeypatch.setattr(store, "INPUT_STORE_MAX_BYTES", 0)
    assert store.input_store(src.store, src.preprocess) is None


def test_cpu_batches_are_made_in_the_callers_thread():
    """On a CPU no second thread runs torch ops beside the training step (it oversubscribed the
    cores: 2.5x slower local training on 2 cores); the items still come lazily, in order."""
    import threading

    from fedadapt.data.sources import prefetched

    made = []

    def make(i):
        made.append((i, threading.current_thread()))
        return (torch.full((2,), float(i)),)

    it = prefetched(3, make, torch.device("cpu"))
    assert made == []  # nothing made before the caller asks
    first = next(it)
    assert torch.equal(first[0], torch.zeros(2)) and [i for i, _ in made] == [0]
    rest = list(it)
    assert [float(t[0][0]) for t in rest] == [1.0, 2.0]
    assert all(t is threading.main_thread() for _, t in made)


def test_variable_size_data_is_stored_at_the_backbone_resize(tmp_path, cache_dir):
    """Images of mixed sizes: the shortest side resized to ``image_size / crop_pct`` with the
    backbone's filter and centre-cropped square, as torchvision's PIL Resize + CenterCrop."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
    from datasets import Image as ImageFeature
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.loading import prepare_dataset
    from fedadapt.data.store import geometry, image_store

    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            for h, w in [(20, 30), (41, 17), (24, 24)] * 4]
    ds = Dataset.from_dict({"image": imgs, "label": [i % 7 for i in range(12)],
                            "domain": ["photo"] * 6 + ["sketch"] * 6},
                           features=Features({"image": ImageFeature(),
                                              "label": ClassLabel(num_classes=7),
                                              "domain": Value("string")}))
    DatasetDict(train=ds).save_to_disk(str(tmp_path / "pacs"))
    prepared = prepare_dataset(DatasetConfig(name="pacs", path=str(tmp_path / "pacs"),
                                             test_fraction=0), cache_dir, seed=0)
    pre = plain(16, 18)
    geo = geometry(load_card("pacs"), pre)
    store = image_store(prepared, "train", geo, cache_dir)
    arr = store.array()
    assert arr.shape == (12, 18, 18, 3) and not geo.native
    order = prepared.load()["train"]
    for i in range(12):
        pil = order[i]["image"]
        ref = T.Compose([T.Resize(18, interpolation=T.InterpolationMode.BICUBIC),
                         T.CenterCrop(18)])(pil.convert("RGB"))
        np.testing.assert_array_equal(arr[i], np.asarray(ref))


def test_corruptions_run_at_native_resolution_seeded_per_image(cache_dir):
    from fedadapt.data.corruptions import corrupt_images

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig(use_cache=False)), quiet=True)
    src = prep.spec.train_source
    idx = np.array([4, 2, 9])
    noisy = src.corrupted("gaussian_noise", 5, seed=7)
    native = noisy.images(idx)
    assert native.shape == (3, 8, 8, 3) and native.dtype == np.uint8  # before any resize
    # the same image, whatever batch it is corrupted in
    alone = corrupt_images(src.store.array()[[2]], "gaussian_noise", 5, 7, np.array([2]))
    np.testing.assert_array_equal(native[1], alone[0])
    x, _ = noisy.get(idx)
    torch.testing.assert_close(x, src.preprocess.apply(torch.from_numpy(native)))
    blurred = src.corrupted("gaussian_blur", 5, seed=0).images(idx)
    assert not np.array_equal(blurred, np.repeat(src.store.array()[idx], 3, axis=-1))


def test_features_move_to_the_device_once_per_call_or_are_read_per_batch(cache_dir,
                                                                          monkeypatch):
    """Off the CPU a call's rows move once (features and labels), then are indexed there; on
    the CPU each batch is read from the mapping. Both give each batch's rows, in its order."""
    from fedadapt.data import sources

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    src = prep.spec.train_source
    calls = []
    real = sources._to_device
    monkeypatch.setattr(sources, "_to_device", lambda t, d: calls.append(t.shape) or real(t, d))
    batches = [np.array([3, 1]), np.array([8]), np.array([1, 2])]  # unsorted, overlapping
    cpu = torch.device("cpu")
    moved = list(sources.feature_stream(src, batches, cpu, move_once=True))
    assert len(calls) == 2  # features and labels, once for all batches
    read = list(src.stream(batches, "cpu"))  # the CPU's default: per batch, nothing moved
    assert len(calls) == 2
    for b, (x, y), (x1, y1) in zip(batches, moved, read):
        np.testing.assert_array_equal(x.numpy(), src.features()[b])
        np.testing.assert_array_equal(y.numpy(), src.labels()[b])
        assert torch.equal(x, x1) and torch.equal(y, y1) and x1.dtype == torch.float32


def test_precision_is_checked_and_resolved(cache_dir, monkeypatch, request):
    from fedadapt import devices

    if request.config.getoption("--auto-precision"):
        pytest.skip("--auto-precision changes what auto resolves to")
    from fedadapt.config import validate

    assert devices.resolve_precision("auto", "cpu") == "fp32"
    assert devices.resolve_precision("fp32", "cpu") == "fp32"
    cfg = tiny_run(cache_dir, LinearHeadConfig())
    cfg.train.precision = "fp16"
    with pytest.raises(ConfigError, match="train.precision='fp16'"):
        validate(cfg)
    monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: False)
    with pytest.raises(ConfigError, match="train.precision=bf16 is invalid here"):
        devices.resolve_precision("bf16", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.run_device(0) == "cpu" and devices.run_device(0.0) == "cpu"
    assert devices.run_device(None) == "cuda" and devices.run_device(0.5) == "cuda"


def test_bf16_holds_frozen_weights_and_trains_fp32_tensors():
    """Under bf16 the frozen backbone's weights are held in bf16; adapters, heads, gradients
    and optimiser state stay fp32, and a step under autocast keeps them fp32."""
    from fedadapt.adapters import build_model
    from fedadapt.adapters.exits import AccumulatorConfig
    from fedadapt.backbones import build_backbone
    from fedadapt.config import BackboneConfig
    from fedadapt.devices import autocast, hold_frozen

    b = build_backbone(BackboneConfig(name="v", family="vit", image_size=32, arch=dict(
        patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32)))
    model = build_model(AccumulatorConfig(head_hidden=[8], parallel_adapter=True,
                                          adapter_bottleneck=4), b, 5, with_backbone=True)
    hold_frozen(model.backbone, "bf16")
    held = {id(p) for m in model.backbone.modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
            for p in m.parameters(recurse=False) if not p.requires_grad}
    assert held
    for n, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if id(p) in held else torch.float32), n
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    with autocast("cpu", "bf16"):
        loss = model.training_loss(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    loss.float().backward()
    opt.step()
    for p in model.parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
