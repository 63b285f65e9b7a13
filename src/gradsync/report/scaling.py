"""Plots of simulated scaling (``gradsync simulate``): scaling efficiency against world size."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..extras import require

__all__ = ["plot_scaling"]


def plot_scaling(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str],
                 title: str | None = None) -> str:
    """Write a PNG of scaling efficiency against world size (log2 x axis), one line per algorithm
    and one panel per bandwidth, from :func:`gradsync.sim.sweep` rows. Renders with matplotlib's Agg canvas
    directly (no pyplot, so the global backend is left alone).

    Returns:
        the path written, as a string.

    Raises:
        ValueError: if ``rows`` is empty or lacks the keys :func:`gradsync.sim.sweep` writes.
    """
    if not rows:
        raise ValueError("rows must be non-empty")
    for k in ("algorithm", "world_size", "bandwidth_gbps", "scaling_efficiency"):
        if k not in rows[0]:
            raise ValueError(f"rows lack key {k!r}; pass the output of sweep()")
    FigureCanvasAgg = require("matplotlib.backends.backend_agg", "the scaling plot").FigureCanvasAgg
    Figure = require("matplotlib.figure", "the scaling plot").Figure

    bws = sorted({r["bandwidth_gbps"] for r in rows})
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig = Figure(figsize=(4.2 * len(bws), 3.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(bws), squeeze=False, sharey=True)[0]
    for ax, bw in zip(axes, bws):
        for algo in algos:
            pts = sorted((r["world_size"], r["scaling_efficiency"]) for r in rows
                         if r["bandwidth_gbps"] == bw and r["algorithm"] == algo)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=algo)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{bw:g} Gbit/s")
        ax.set_xlabel("world size (ranks)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("scaling efficiency")
    axes[-1].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(os.fspath(path), dpi=110)
    return os.fspath(path)
