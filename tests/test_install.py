"""The package imports as documented, the dataset catalogue never shadows HF datasets, and a
built wheel finds its configuration and catalogue through the installed package."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_strategies_and_clients_install_under_fedadapt():
    import fedadapt.clients.app
    import fedadapt.strategies.fedavg

    assert Path(fedadapt.strategies.fedavg.__file__).parent.name == "strategies"
    assert Path(fedadapt.clients.app.__file__).parent.name == "clients"


@pytest.mark.slow
def test_datasets_from_repo_root_is_hugging_face():
    out = subprocess.run([sys.executable, "-c", "import datasets; print(datasets.__file__)"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "site-packages" in out and not (REPO / "datasets" / "__init__.py").exists()


@pytest.mark.slow
def test_torchvision_imports_after_fedadapt():
    out = subprocess.run([sys.executable, "-c",
                          "import fedadapt, torchvision, timm, open_clip; print('ok')"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory) -> Path:
    """``python -m build --wheel`` of this checkout, unpacked as pip would install it."""
    tmp = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                          "--outdir", str(tmp / "dist"), str(REPO)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = (tmp / "dist").glob("fedadapt-*.whl")
    site = tmp / "site"
    zipfile.ZipFile(wheel).extractall(site)
    return site


# In a fresh process whose first sys.path entry is the unpacked wheel, started outside the
# repository: the shipped config composes through Hydra's pkg:// path and the catalogue lists
# every card, and both come from the wheel, not from this checkout.
PROBE = """
import fedadapt, fedadapt.paths as paths
from fedadapt.data.catalogue import available, load_card
from fedadapt.entry import compose_config
cfg = compose_config([], default_experiment="quickstart")
print(fedadapt.__file__)
print(cfg.experiment, cfg.dataset.name, ",".join(cfg.compare))
print(",".join(available()))
print(load_card("vlcs").name, paths.catalogue_file("vlcs.md").is_file())
print(paths.conf_file("experiment", "quickstart.yaml").is_file())
"""


@pytest.mark.slow
def test_wheel_finds_conf_and_catalogue_from_any_directory(unpacked_wheel, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(unpacked_wheel)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    location, job, cards, vlcs, quickstart = out.stdout.strip().splitlines()
    assert location.startswith(str(unpacked_wheel))
    assert job == "quickstart digits linear_head,mlp_head,finetune,local_only"
    shipped = sorted(p.stem for p in (REPO / "datasets").glob("*.yaml"))
    assert cards.split(",") == shipped
    assert vlcs == "vlcs True" and quickstart == "True"


@pytest.mark.slow
def test_wheel_ships_every_config_and_card(unpacked_wheel):
    """Every YAML under conf/ (any depth) and every card and recipe under datasets/ is in the
    wheel, where the installed package looks for them."""
    for path in (REPO / "conf").rglob("*.yaml"):
        assert (unpacked_wheel / "fedadapt" / "conf" / path.relative_to(REPO / "conf")).is_file()
    for path in (REPO / "datasets").iterdir():
        assert (unpacked_wheel / "fedadapt" / "catalogue" / path.name).is_file(), path


def test_every_package_folder_is_in_the_wheel_list():
    """pyproject.toml lists the packages (strategies/, clients/ and conf/ install under
    fedadapt); a new folder of code (a method family in fedadapt/methods/) must be in the list
    or the wheel ships without it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    folders = {".".join(p.parent.relative_to(REPO).parts)
               for p in (REPO / "fedadapt").rglob("__init__.py")
               if "catalogue" not in p.parts}
    assert folders <= listed, f"add {sorted(folders - listed)} to pyproject.toml's packages"
