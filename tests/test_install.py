"""The package imports as documented, and the dataset catalogue never shadows HF datasets."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_strategies_and_clients_install_under_fedadapt():
    import fedadapt.clients.app
    import fedadapt.strategies.fedavg

    assert Path(fedadapt.strategies.fedavg.__file__).parent.name == "strategies"
    assert Path(fedadapt.clients.app.__file__).parent.name == "clients"


def test_datasets_from_repo_root_is_hugging_face():
    out = subprocess.run([sys.executable, "-c", "import datasets; print(datasets.__file__)"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "site-packages" in out and not (REPO / "datasets" / "__init__.py").exists()


def test_torchvision_imports_after_fedadapt():
    out = subprocess.run([sys.executable, "-c",
                          "import fedadapt, torchvision, timm, open_clip; print('ok')"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
