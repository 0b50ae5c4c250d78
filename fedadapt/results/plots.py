"""``curves.png``: accuracy against round and against cumulative bytes, one line per run;
``accuracy_vs_time.png``: accuracy against a simulated fleet's clock, one colour per group."""

from __future__ import annotations

from pathlib import Path

#: The accuracies ``curves.png`` draws (solid and dotted).
CURVE_KEYS = ("global_acc", "client_acc")


def has_curve(rows: list[dict]) -> bool:
    """Whether a run's metrics rows hold a curve: some accuracy measured at two rounds or
    more. A run evaluated once (``federation.eval_every`` = ``rounds``) has its one number in
    ``table.md``; a plot of single dots says nothing more and costs most of a second to draw
    (matplotlib's import), so no ``curves.png`` is drawn for it."""
    return any(sum(r.get(key) is not None for r in rows) >= 2 for key in CURVE_KEYS)


def plot_curves(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """``runs`` maps a label to its metrics rows; writes the PNG atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedadapt.files import atomic_write

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rows) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        for key, style in zip(CURVE_KEYS, ("-", ":")):
            pts = [(r["round"], r["cum_bytes"], r[key]) for r in rows if r.get(key) is not None]
            if not pts:
                continue
            name = f"{label} ({'global' if key == 'global_acc' else 'client-mean'})"
            axes[0].plot([p[0] for p in pts], [100 * p[2] for p in pts], style, color=color,
                         label=name, marker=".")
            sent = [p for p in pts if p[1] > 0]  # local-only runs send nothing
            if sent:
                axes[1].plot([p[1] / 1e6 for p in sent], [100 * p[2] for p in sent], style,
                             color=color, marker=".", label=name)
    axes[0].set_xlabel("round")
    axes[1].set_xlabel("cumulative bytes sent up + down (MB)")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110), mode="wb")
    plt.close(fig)


#: At most this many clients are drawn in ``partition.png`` (the first ones, by client id).
MAX_PLOTTED_CLIENTS = 60


def plot_partition(partition, labels, path: str | Path, *, class_names: list[str] | None = None,
                   title: str = "") -> None:
    """``partition.png``: samples of each class on each client (train + val + test), drawn by
    ``flwr_datasets.visualization.plot_label_distributions`` from the final partition (after
    held-out domains, grouping and sub-sampling). Stacked bars with a legend up to 20 classes, a
    heatmap above; the first :data:`MAX_PLOTTED_CLIENTS` clients. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from flwr_datasets.partitioner import Partitioner
    from flwr_datasets.visualization import plot_label_distributions

    from datasets import ClassLabel, Dataset, Features
    from fedadapt.files import atomic_write

    class Fixed(Partitioner):
        """The partition already made, as a flwr-datasets Partitioner."""

        def __init__(self, indices: list) -> None:
            super().__init__()
            self._indices = indices

        def load_partition(self, partition_id: int):
            return self.dataset.select(self._indices[partition_id])

        @property
        def num_partitions(self) -> int:
            return len(self._indices)

    labels = np.asarray(labels, dtype=np.int64)
    num_classes = int(labels.max()) + 1 if len(labels) else 1
    names = list(class_names or [])[:num_classes]
    names += [str(i) for i in range(len(names), num_classes)]
    fixed = Fixed([np.concatenate([c.train, c.val, c.test]) for c in partition.clients])
    fixed.dataset = Dataset.from_dict({"label": labels.tolist()},
                                      features=Features({"label": ClassLabel(names=names)}))
    shown = min(len(partition.clients), MAX_PLOTTED_CLIENTS)
    few = num_classes <= 20
    size = ((min(16.0, 4.0 + 0.25 * shown), 4.5) if few  # clients along x
            else (min(16.0, 4.0 + 0.12 * num_classes), max(4.5, 1.5 + 0.18 * shown)))
    fig, ax = plt.subplots(figsize=size)
    more = f" (first {shown} of {len(partition.clients)} clients)" if shown < len(
        partition.clients) else ""
    plot_label_distributions(fixed, label_name="label", plot_type="bar" if few else "heatmap",
                             max_num_partitions=shown, axis=ax, legend=few,
                             legend_title="class", title=(title or "classes per client") + more,
                             partition_id_axis="x" if few else "y")
    fig.tight_layout()
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=100, bbox_inches="tight"),
                 mode="wb")  # the legend sits outside the axes
    plt.close(fig)


def write_partition_plot(run, partition, labels, path: str | Path,
                         class_names: list[str] | None = None) -> None:
    """:func:`plot_partition` titled with the run's data set, partitioner, clients and seed
    (``run``: a :class:`~fedadapt.config.RunConfig`). The picture is kept in
    ``<cache_dir>/plots/`` under a digest of everything drawn (the title, the class names, the
    labels and every client's rows), and a later run of the same partition copies it: drawing
    it imports flwr-datasets' plotting (seaborn, scipy.stats: 1.7 s here) and draws for about a
    second, which a short run waited for after its last round."""
    import hashlib
    import shutil

    import numpy as np

    from fedadapt.files import atomic_write

    p = run.partition
    alpha = f" alpha={p.alpha}" if p.kind in ("dirichlet", "inner_dirichlet") else ""
    title = (f"{run.dataset.name}: partition={p.kind}{alpha}, {len(partition.clients)} "
             f"clients, seed {run.seed}")
    digest = hashlib.sha256(f"{title}\n{class_names}\n{MAX_PLOTTED_CLIENTS}".encode())
    digest.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    for c in partition.clients:
        for rows in (c.train, c.val, c.test):
            digest.update(np.ascontiguousarray(rows, dtype=np.int64).tobytes())
            digest.update(b"|")
    kept = Path(run.cache_dir).expanduser() / "plots" / f"partition-{digest.hexdigest()[:24]}.png"
    if kept.is_file():
        with open(kept, "rb") as src:
            atomic_write(path, lambda fh: shutil.copyfileobj(src, fh), mode="wb")
        return
    plot_partition(partition, labels, path, class_names=class_names, title=title)
    try:  # for the next run of this partition; a failed copy costs it a drawing
        with open(path, "rb") as src:
            atomic_write(kept, lambda fh: shutil.copyfileobj(src, fh), mode="wb")
    except OSError:
        pass


def plot_accuracy_vs_time(groups: dict[str, list[list[dict]]], path: str | Path) -> None:
    """``groups`` maps a label to its runs' metrics rows (``sim_time_s``, ``global_acc``): each
    run a line against simulated hours, a group's runs in one colour. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedadapt.files import atomic_write

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, runs) in enumerate(groups.items()):
        for j, rows in enumerate(runs):
            pts = [(r["sim_time_s"] / 3600, 100 * r["global_acc"]) for r in rows
                   if r.get("global_acc") is not None and r.get("sim_time_s") is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[i % len(colors)],
                        marker=".", alpha=0.8, label=label if j == 0 else None)
    ax.set_xlabel("simulated time (hours)")
    ax.set_ylabel("global test accuracy (%)")
    ax.grid(alpha=0.3)
    # below the axes: long labels never cover the lines
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"),
                 mode="wb")
    plt.close(fig)
