"""Statistics over seeds for the reports: the sample standard deviation and Student's t
confidence interval of the mean.

A cell of a report summarises the runs that differ only in their seed. With ``n`` seeds it
shows the mean; from 2 seeds on ``± s`` with the *sample* standard deviation (``n - 1`` in the
denominator, ``ddof = 1``: the seeds are a sample of the seeds one could draw); from 3 seeds on
also ``[lo, hi]``, the 95% confidence interval of the mean, ``mean ± t(0.975, n - 1) * s /
sqrt(n)`` (``scipy.stats.t``). Every report states this convention in its header
(:data:`CONVENTION`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

#: Confidence level of the intervals.
LEVEL = 0.95
#: Seeds from which a cell shows a confidence interval.
MIN_SEEDS_FOR_CI = 3
#: The line every report header carries.
CONVENTION = ("Cells: mean ± sample standard deviation over seeds (ddof = 1, n - 1 in the "
              "denominator); [95% confidence interval of the mean, Student's t with n - 1 "
              "degrees of freedom] from 3 seeds on; with one seed, its value alone.")


@dataclass(frozen=True)
class SeedStats:
    """Mean, sample std (None for one value) and confidence interval (None below
    :data:`MIN_SEEDS_FOR_CI` values) of ``n`` values."""

    n: int
    mean: float
    std: Optional[float]
    ci: Optional[tuple[float, float]]


def describe(values: Sequence[float], *, level: float = LEVEL) -> Optional[SeedStats]:
    """:class:`SeedStats` of ``values`` (None when there are none)."""
    vals = [float(v) for v in values]
    if not vals:
        return None
    n, mean = len(vals), statistics.fmean(vals)
    std = statistics.stdev(vals) if n > 1 else None
    ci = None
    if n >= MIN_SEEDS_FOR_CI:
        from scipy.stats import t

        half = float(t.ppf(0.5 + level / 2, df=n - 1)) * std / math.sqrt(n)
        ci = (mean - half, mean + half)
    return SeedStats(n=n, mean=mean, std=std, ci=ci)


def fmt(stats: Optional[SeedStats], digits: int = 2) -> str:
    """``"81.02"``, ``"81.02 ± 2.71"`` or ``"81.02 ± 2.71 [74.29, 87.75]"``; ``"—"`` for None."""
    if stats is None:
        return "—"
    out = f"{stats.mean:.{digits}f}"
    if stats.std is not None:
        out += f" ± {stats.std:.{digits}f}"
    if stats.ci is not None:
        out += f" [{stats.ci[0]:.{digits}f}, {stats.ci[1]:.{digits}f}]"
    return out


def fmt_values(values: Sequence[float], digits: int = 2) -> str:
    """:func:`fmt` of :func:`describe`."""
    return fmt(describe(values), digits)
