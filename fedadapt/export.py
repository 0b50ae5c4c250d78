"""``fedadapt-export RUN_DIR [--out DIR] [--merge]``: a finished run's global model, out in the
format the ecosystem loads.

The model is the run's last checkpoint (the final global model; ``summary.json``'s ``final``
row), rebuilt exactly as the run built it (:func:`fedadapt.experiment.prepare_run`: the same
backbone weights, the same seeded initialisation, hence FFA-LoRA's frozen ``A``).

* A PEFT method (``lora``, ``dora``, ``ia3``): a PEFT adapter folder written by peft's own
  ``PeftModel.save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``) for the
  backbone's tuning module (the transformers ``ViTModel`` / ``ASTModel``, CLIP's image tower,
  EfficientNet), so ``peft.PeftModel.from_pretrained(base, DIR)`` loads it; ``--merge`` also
  writes ``merged/``, the base with the update merged in (``merge_and_unload``). Under FLoRA
  and FedEx-LoRA, which fold updates into the frozen weights, ``base/`` is the base with those
  folded in (``W0 + s * base_delta``; always written), the adapter the global LoRA on top, and
  ``folded.safetensors`` the updates themselves.
* ``bitfit``: ``backbone_biases.safetensors``, the trained biases to load over the base.
* Every other client-trained method: ``model.safetensors``, the global trainable tensors under
  fedadapt's names, which :func:`load_export` puts back into the rebuilt model.

Beside it, always: ``head.safetensors`` (the classifier on the pooled feature; one head per exit
for a model with exits), ``base/`` unless the backbone's weights came from the hub (random or
package weights, a local folder), ``fedadapt_export.json`` (the run's config, round, accuracy,
preprocessing) and a ``README.md`` with the loading code for this export: through fedadapt, and
for a PEFT adapter on a transformers backbone with transformers and peft alone (with
``torchvision_shim.py`` beside it where this install's torchvision needs it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from fedadapt import _compat
from fedadapt.config import ConfigError, FedadaptError

EXPORT_JSON = "fedadapt_export.json"
#: A copy of :mod:`fedadapt._compat` written beside a PEFT export where this install needs it
#: (a CPU torch beside a CUDA torchvision wheel), so the README's snippet needs no fedadapt.
SHIM = "torchvision_shim.py"
#: FLoRA's and FedEx-LoRA's folded updates (``X.base_delta``, fedadapt's names), beside a PEFT
#: adapter whose ``base/`` holds them folded in.
FOLDED = "folded.safetensors"


def read_run(run_dir: Path):
    """``(RunConfig, summary)`` of a finished run directory; ConfigError naming what is missing."""
    from fedadapt.entry import run_config_from
    from fedadapt.rundir import JOB, resume_command

    summary_path, config_path = run_dir / "summary.json", run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise ConfigError(f"fedadapt-export: {run_dir} has no summary.json: no such folder "
                          f"(name a run directory, the folder `fedadapt` writes a run's "
                          f"summary.json into)")
    if not summary_path.is_file():
        job = next((d for d in (run_dir, run_dir.parent) if (d / JOB).is_file()), None)
        if runs := sorted(p.parent.name for p in run_dir.glob("*/summary.json")):
            hint = f" (a job folder: export one of its runs, {', '.join(runs)})"
        elif config_path.is_file() and job is not None:
            hint = f"; the run did not finish: `{resume_command(job)}` completes it"
        else:
            hint = (" and no config.yaml: not a run directory (name the folder `fedadapt` "
                    "writes a run's summary.json into)" if not config_path.is_file() else
                    " and no job.json beside it: not a run `fedadapt` can finish")
        raise ConfigError(f"fedadapt-export: {run_dir} has no summary.json{hint}")
    if not config_path.is_file():
        raise ConfigError(f"fedadapt-export: {run_dir} has no config.yaml (not a run directory)")
    try:
        summary = json.loads(summary_path.read_text())
        cfg = run_config_from(config_path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"fedadapt-export: {run_dir} is unreadable: "
                          f"{str(err).splitlines()[0]}") from err
    return cfg, summary


def rebuild(run_dir: Path, *, quiet: bool = True):
    """``(prepared run, arrays, round)``: the run's model as the run built it, holding the
    global tensors of its last checkpoint."""
    from fedadapt.adapters.registry import method_spec
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint

    cfg, summary = read_run(run_dir)
    if method_spec(cfg.method).family != "rounds":
        raise ConfigError(f"fedadapt-export: method={cfg.method.name} is trained on the server "
                          f"(its module is in {run_dir / 'checkpoints'}); fedadapt-export "
                          f"writes the global model of a client-trained method")
    folder = latest_checkpoint(run_dir)
    if folder is None:
        raise ConfigError(f"fedadapt-export: {run_dir} has no checkpoint")
    arrays, state = load_checkpoint(folder)
    prep = prepare_run(cfg, quiet=quiet)
    model = prep.model
    if not model.communicated_names():
        raise ConfigError(f"fedadapt-export: method={cfg.method.name} has no global model "
                          f"(every tensor stays on its client)")
    model.load_tensors(arrays)
    return prep, arrays, int(state.get("round", summary.get("rounds", 0))), summary


def export_run(run_dir, out=None, *, merge: bool = False, quiet: bool = True) -> Path:
    """Write the export of ``run_dir`` to ``out`` (default ``RUN_DIR/export``), atomically."""
    run_dir = Path(run_dir).expanduser().resolve()
    out = Path(out).expanduser().resolve() if out else run_dir / "export"
    cfg, _ = read_run(run_dir)
    if getattr(cfg.method, "share", "both") == "a":
        raise ConfigError(f"{run_dir} is a FedSA-LoRA run (method.share=a): each client keeps "
                          f"its own B, so the global model has no adapter to export (its A and "
                          f"head are in the run's last checkpoint; a client's B in "
                          f"clients/<id>/)")
    prep, arrays, rnd, summary = rebuild(run_dir, quiet=quiet)
    model = prep.model.cpu().float()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        kind, base_class = _write(model, cfg, tmp, merge)
        from fedadapt.adapters.lora import is_base_delta

        folded = {n: t.contiguous() for n, t in arrays.items() if is_base_delta(n)}
        if folded:  # FLoRA / FedEx-LoRA: the updates folded into base/'s weights, for fedadapt
            from safetensors.torch import save_file

            save_file(folded, tmp / FOLDED)
        if prep.spec.class_text is not None:  # CLIP methods: the class prompts' features
            from safetensors.torch import save_file

            save_file({"features": prep.spec.class_text.features.contiguous()},
                      tmp / "class_text.safetensors")
        meta = _meta(cfg, prep, summary, rnd, run_dir, kind)
        meta["base_folder"] = "base" if (tmp / "base").exists() else None
        meta["base_class"] = base_class
        shim = _compat.TORCHVISION_OPS_STUBBED and kind == "peft"
        if shim:  # this install's torchvision needs it before transformers imports
            shutil.copyfile(_compat.__file__, tmp / SHIM)
        (tmp / EXPORT_JSON).write_text(json.dumps(meta, indent=1))
        (tmp / "README.md").write_text(_readme(meta, out, shim=shim))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _write(model, cfg, out: Path, merge: bool) -> tuple[str, Optional[str]]:
    """The model's files; returns the export's kind (``peft``, ``bitfit`` or ``fedadapt``) and,
    for a PEFT adapter on a transformers model, the base's class (``ViTModel``)."""
    from safetensors.torch import save_file

    head = {k: v.detach().contiguous() for k, v in model.head.state_dict().items()}
    save_file(head, out / "head.safetensors")
    if getattr(model, "peft_config", None) is not None:
        return "peft", _write_peft(model, cfg, out, merge)
    if model.tuner_names():  # BitFit: the backbone's trained biases
        prefix = model.tuned_prefix + "."
        biases = {n[len(prefix):]: t for n, t in model.tensors(model.tuner_names()).items()}
        save_file(biases, out / "backbone_biases.safetensors")
        _write_base(model, cfg, out)
        return "bitfit", None
    names = model.communicated_names()
    save_file({n: t.contiguous() for n, t in model.tensors(names).items()},
              out / "model.safetensors")
    return "fedadapt", None


def _base(model, cfg):
    """The untuned tuning module, as the run built it, with the frozen weights the global model
    folded its updates into (FLoRA, FedEx-LoRA: ``W0 + s * base_delta``) where it did."""
    from fedadapt.backbones import build_backbone

    base = build_backbone(cfg.backbone).tuning_module()
    prefix = model.tuned_prefix + "."
    with torch.no_grad():
        for name, layer in _folded_layers(model).items():
            target = base.get_submodule(name[len(prefix):].rsplit(".", 1)[0])
            target.weight.copy_(layer.get_base_layer().weight)
    return base


def _folded_layers(model) -> dict:
    """The model's LoRA layers whose frozen weight holds a folded update (by ``X.base_delta``)."""
    layers = model.lora_layers() if hasattr(model, "lora_layers") else {}
    return {n: m for n, m in layers.items() if hasattr(m, "fedadapt_w0")}


def _write_base(model, cfg, out: Path) -> Optional[str]:
    """``base/``: the untuned tuning module (with the global model's folded updates), unless its
    weights came from the hub as they are (then named by their hub id); returns ``"base"`` or
    None."""
    if hub_id(cfg.backbone.weights) and not _folded_layers(model):
        return None  # the base loads by its hub id
    # random or package weights, a local folder (a cache on this machine), or folded weights:
    # copied beside
    base = _base(model, cfg)
    if hasattr(base, "save_pretrained"):
        base.save_pretrained(out / "base")
    else:
        from safetensors.torch import save_file

        (out / "base").mkdir()
        save_file({k: v.contiguous() for k, v in base.state_dict().items()},
                  out / "base" / "model.safetensors")
    return "base"


def hub_id(weights) -> Optional[str]:
    """``weights`` when it names a Hugging Face hub model (``org/name``), else None (random or
    package weights, a local folder)."""
    text = str(weights or "")
    if not text or text in ("random", "package") or text.startswith(("/", ".", "~")) \
            or Path(text).expanduser().exists():
        return None
    return text


def _write_peft(model, cfg, out: Path, merge: bool) -> Optional[str]:
    """peft's own adapter folder for a fresh copy of the tuning module holding the trained
    tuner tensors; ``merged/`` with ``merge_and_unload``. Returns the base's transformers
    class name (None for a base transformers does not define)."""
    import copy

    from peft import get_peft_model

    folder = _write_base(model, cfg, out)
    base = _base(model, cfg)
    base_class = type(base).__name__ if type(base).__module__.startswith("transformers.") \
        else None
    config = copy.deepcopy(model.peft_config)
    config.inference_mode = True
    with warnings.catch_warnings():  # peft renames a base it cannot name (we set it below)
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(base, config)
    # where the base comes from: base/ beside the adapter, or the weights' hub id / folder
    peft_model.peft_config["default"].base_model_name_or_path = folder or cfg.backbone.weights
    trained = model.get_submodule(model.tuned_prefix).state_dict()
    target = peft_model.base_model.model
    own = target.state_dict()
    tuner = {k: v for k, v in trained.items() if k in own and _tuner_key(k)}
    if not tuner:
        raise RuntimeError("export: no tuner tensor of the trained model matched the adapter")
    target.load_state_dict(tuner, strict=False)
    peft_model.save_pretrained(str(out))
    if merge:
        merged = peft_model.merge_and_unload()
        if hasattr(merged, "save_pretrained"):
            merged.save_pretrained(out / "merged")
        else:
            from safetensors.torch import save_file

            (out / "merged").mkdir()
            save_file({k: v.contiguous() for k, v in merged.state_dict().items()},
                      out / "merged" / "model.safetensors")
    return base_class


def _tuner_key(key: str) -> bool:
    return any(p in key for p in (".lora_A.", ".lora_B.", ".lora_magnitude_vector.", ".ia3_l."))


def _meta(cfg, prep, summary: dict, rnd: int, run_dir: Path, kind: str) -> dict:
    from dataclasses import asdict

    model = prep.model
    bb = model.backbone
    head = cfg.method.head if hasattr(cfg.method, "head") else None
    return {
        "format": kind,
        "method": cfg.method.name,
        "num_classes": prep.spec.num_classes,
        "class_text": None if prep.spec.class_text is None else {
            "prompts": list(prep.spec.class_text.prompts),
            "logit_scale": prep.spec.class_text.logit_scale},
        "round": rnd,
        "global_acc": (summary.get("final") or {}).get("global_acc"),
        "run_dir": str(run_dir),
        "git_commit": summary.get("git_commit"),
        "head": {"kind": head, "exits": bool(getattr(model, "has_exits", False)),
                 "final_norm": bool(getattr(model.head, "final_norm", False))},
        "preprocessing": None if bb is None else {
            "image_size": bb.image_size, "crop_pct": bb.crop_pct,
            "interpolation": bb.interpolation, "mean": list(bb.mean), "std": list(bb.std)},
        "config": asdict(cfg),
    }


def _readme(meta: dict, folder: Path, *, shim: bool = False) -> str:
    """The loading code for this export: through fedadapt, and for a PEFT adapter on a
    transformers model with transformers and peft alone (what tests/test_export_standalone.py
    runs in a fresh process)."""
    m = meta["method"]
    lines = [f"# fedadapt export: method={m}, round {meta['round']}", "",
             f"Global accuracy of this model on the run's test split: {meta['global_acc']}", "",
             "```python", "import fedadapt  # first: its torchvision shim (a no-op elsewhere)",
             "from fedadapt.export import load_export", "",
             f'model = load_export("{folder}")  # the AdaptedModel: model(images) -> logits',
             "```", ""]
    if meta["format"] == "peft":
        lines += _peft_snippet(meta, folder, shim)
    return "\n".join(lines)


def _peft_snippet(meta: dict, folder: Path, shim: bool) -> list[str]:
    """The README's "with transformers and peft alone" section."""
    cfg = meta["config"]
    source = "f\"{FOLDER}/base\"" if meta["base_folder"] else repr(cfg["backbone"]["weights"])
    cls = meta["base_class"]
    if cls is None:  # open_clip's image tower, EfficientNet: no transformers class to load
        return [f"The adapter is peft's (`PeftModel.from_pretrained(base, {str(folder)!r})`); "
                f"its base is {cfg['backbone']['name']}'s own network, not a transformers model: "
                f"build it with fedadapt (above), or from base/ with that package.", ""]
    vit = cfg["backbone"]["family"] == "vit" and not meta["head"]["exits"]
    lines = ["With transformers and peft alone (a fresh Python, no fedadapt):", "", "```python",
             f"FOLDER = {str(folder)!r}  # this export's folder"]
    if shim:
        lines += ["# This install's torchvision wheel does not match its torch "
                  "(`operator torchvision::nms does not exist` when transformers imports it): "
                  f"{SHIM}, beside this README, declares its ops (drop these lines on a matching "
                  "install).",
                  "import sys; sys.path.insert(0, FOLDER); import torchvision_shim  "
                  "# noqa: E401,E702,F401"]
    lines += ["import torch", "from peft import PeftModel", "from safetensors.torch import "
              "load_file", f"from transformers import {cls}", "",
              f"base = {cls}.from_pretrained({source}" + (", add_pooling_layer=False)" if vit
                                                          else ")"),
              "tuned = PeftModel.from_pretrained(base, FOLDER).eval()",
              'head = load_file(f"{FOLDER}/head.safetensors")']
    if vit and meta["head"]["kind"] in (None, "linear"):
        prep = meta["preprocessing"]
        lines += ["", "", "def logits(pixel_values):",
                  f'    """[B, 3, {prep["image_size"]}, {prep["image_size"]}] images, '
                  f'normalised with mean {prep["mean"]} and std {prep["std"]}."""',
                  "    with torch.no_grad():",
                  "        out = tuned(pixel_values=pixel_values, interpolate_pos_encoding=True)",
                  "        feature = out.last_hidden_state[:, 0]  # the pooled feature (CLS)",
                  '        return torch.nn.functional.linear(feature, head["weight"], '
                  'head["bias"])']
    else:
        lines += ["# the head (head.safetensors) takes the pooled feature as fedadapt's "
                  f"{cfg['backbone']['name']} backbone computes it (fedadapt_export.json)"]
    return lines + ["```", ""]


def load_export(folder) -> torch.nn.Module:
    """The model of an export, rebuilt from its config with the exported tensors loaded
    (PEFT tensors through peft's own loader); eval mode, on the CPU."""
    from safetensors.torch import load_file

    from fedadapt.backbones import build_backbone
    from fedadapt.entry import run_config_from
    from fedadapt.federation.client.training import seeded_model

    folder = Path(folder)
    meta_path = folder / EXPORT_JSON
    if not meta_path.is_file():
        raise ConfigError(f"{folder} holds no {EXPORT_JSON}: not a fedadapt-export folder")
    meta = json.loads(meta_path.read_text())
    cfg = run_config_from(meta["config"])
    backbone = build_backbone(cfg.backbone)
    text = None
    if meta.get("class_text"):
        from fedadapt.backbones.clip import ClassText

        text = ClassText(prompts=tuple(meta["class_text"]["prompts"]),
                         features=load_file(folder / "class_text.safetensors")["features"],
                         logit_scale=float(meta["class_text"]["logit_scale"]))
    model = seeded_model(cfg.method, cfg.seed, backbone, meta["num_classes"],
                         with_backbone=True, class_text=text)
    if (folder / FOLDED).is_file():  # FLoRA / FedEx-LoRA: the frozen weights' folded updates
        model.load_tensors(load_file(folder / FOLDED))
    if meta["format"] == "peft":
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        module = model.get_submodule(model.tuned_prefix)
        set_peft_model_state_dict(module, load_peft_weights(str(folder)))
    elif meta["format"] == "bitfit":
        module = model.get_submodule(model.tuned_prefix)
        module.load_state_dict(load_file(folder / "backbone_biases.safetensors"), strict=False)
    else:
        model.load_tensors(load_file(folder / "model.safetensors"))
    model.head.load_state_dict(load_file(folder / "head.safetensors"))
    return model.eval()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedadapt-export",
        description="Write a finished run's global model in the format the ecosystem loads: a "
                    "PEFT adapter folder (peft.PeftModel.from_pretrained) for lora / dora / ia3, "
                    "the trained biases for bitfit, a safetensors file for every other method; "
                    "the head, the config and a loading snippet beside it.")
    parser.add_argument("run_dir", help="a run directory (it holds summary.json)")
    parser.add_argument("--out", help="the export folder (default RUN_DIR/export)")
    parser.add_argument("--merge", action="store_true",
                        help="also write merged/: the base with the adapter merged in")
    args = parser.parse_args(argv)
    try:
        out = export_run(args.run_dir, args.out, merge=args.merge, quiet=False)
    except FedadaptError as err:  # a bad run directory, a corrupt checkpoint, missing weights
        print(f"fedadapt-export: error: {str(err).removeprefix('fedadapt-export: ')}",
              file=sys.stderr)
        return 2
    except OSError as err:  # a full disk or an unwritable --out: the OS's own words
        print(f"fedadapt-export: error: {err.filename or args.out}: {err.strerror or err}",
              file=sys.stderr)
        return 1
    print(f"Exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
