"""``curves.png``: accuracy against round and against cumulative bytes, one line per run."""

from __future__ import annotations

from pathlib import Path


def plot_curves(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """``runs`` maps a label to its metrics rows; writes the PNG atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedadapt.results.store import atomic_write

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rows) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        for key, style in (("global_acc", "-"), ("client_acc", ":")):
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
