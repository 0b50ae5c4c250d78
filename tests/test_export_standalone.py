"""``fedadapt-export`` stands alone: the PEFT snippet its README writes runs in a fresh Python
with transformers and peft alone (and, on this install, the torchvision shim it writes beside
itself) and gives the logits fedadapt's own loader gives; the base goes into ``base/`` unless it
came from the hub; a folder that is not a run is answered with the right advice."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_run
from test_grouped import TINY_VIT

from fedadapt.config import ConfigError


@pytest.mark.slow
def test_the_peft_snippet_runs_in_a_fresh_process_to_fedadapts_logits(cache_dir, tmp_path):
    from omegaconf import OmegaConf

    from fedadapt import _compat
    from fedadapt.adapters.lora import LoraMethodConfig
    from fedadapt.experiment import run_experiment
    from fedadapt.export import SHIM, export_run, load_export
    from fedadapt.federation.simulation.inprocess import run_in_process

    cfg = tiny_run(cache_dir, LoraMethodConfig(rank=2), backbone=TINY_VIT, rounds=1)
    run_experiment(cfg, tmp_path / "lora", execute=run_in_process,
                   config_yaml=OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    out = export_run(tmp_path / "lora", tmp_path / "exported")
    assert (out / "base" / "config.json").is_file()  # random weights: the base is written
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "base"
    assert (out / SHIM).is_file() == _compat.TORCHVISION_OPS_STUBBED

    readme = (out / "README.md").read_text()
    code = readme.split("With transformers and peft alone")[1].split("```python\n")[1]
    code = code.split("```")[0]
    assert ("import torchvision_shim" in code) == _compat.TORCHVISION_OPS_STUBBED
    probe = code + textwrap.dedent("""
        import json, sys
        assert not [m for m in sys.modules if m.split(".")[0] == "fedadapt"]
        torch.manual_seed(0)
        print(json.dumps(logits(torch.randn(2, 3, 32, 32)).tolist()))
        """)
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.tensor(json.loads(res.stdout.splitlines()[-1]))
    torch.manual_seed(0)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = load_export(out)(images)
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)


def test_the_base_is_written_unless_it_came_from_the_hub(tmp_path):
    from fedadapt.export import hub_id

    local = tmp_path / "pretrained" / "small_vit-fashion_mnist-s0"  # a cache on this machine
    local.mkdir(parents=True)
    assert hub_id("google/vit-base-patch16-224-in21k") == "google/vit-base-patch16-224-in21k"
    for weights in (None, "", "random", "package", str(local), "./x", "~/x", "/no/such"):
        assert hub_id(weights) is None, weights


@pytest.mark.parametrize("make,says", [
    (lambda p: p / "nonexistent", "no such folder"),
    (lambda p: p, "no config.yaml: not a run directory"),
])
def test_a_folder_that_is_not_a_run_is_not_told_to_resume(tmp_path, make, says, capsys):
    from fedadapt.export import main

    assert main([str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert says in err and "resume" not in err and err.count("\n") == 1, err


def test_an_unfinished_run_is_told_its_resume_command(tmp_path):
    from fedadapt.export import read_run

    run = tmp_path / "job dir"
    run.mkdir()
    (run / "config.yaml").write_text("x: 1\n")
    (run / "job.json").write_text('{"overrides": []}')
    with pytest.raises(ConfigError, match="the run did not finish: `fedadapt resume='.*job dir'"):
        read_run(run)
