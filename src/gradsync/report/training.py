"""Report a ``gradsync train`` run: a rich summary table, ``metrics.json`` and ``curves.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..extras import pyplot


def fmt_bytes(n: float) -> str:
    """Human-readable byte count (B, KB, MB, GB; powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("algorithm", s["algorithm"] + (f" (K={s['ratio']})" if "ratio" in s else "")),
        *([("auto chose", f"{s['auto_choice']}: {s['auto_reason']}")] if "auto_choice" in s else []),
        ("world size", str(s["world_size"])),
        *([("network", s["network"])] if "network" in s else []),
        *([("process group", s["backend"])] if "backend" in s else []),  # backend (why)
        ("epochs", f"{s['epochs']} ({s['steps']} steps)"),
        ("final test accuracy", f"{s['test_accuracy'] * 100:.2f}%"
                                + (f" ({s['test_samples']:,} test samples)" if "test_samples" in s else "")),
        ("samples/s", f"{s['samples_per_s']:.1f}"),
        ("mean iteration time", f"{s['mean_iteration_s'] * 1e3:.1f} ms"),
        ("mean compute time (fwd+bwd, no comm)", f"{s['mean_compute_s'] * 1e3:.1f} ms"),
        ("wire bytes per rank per iteration", fmt_bytes(s["wire_bytes_per_iteration"])),
        ("payload bytes per rank per iteration", fmt_bytes(s["payload_bytes_per_iteration"])),
        ("compression ratio (dense all-reduce wire bytes / wire bytes)", f"{s['compression_ratio']:.2f}x"),
    ]
    if "bits_per_char" in s:
        rows.append(("validation bits per character", f"{s['bits_per_char']:.3f}"))
    if "ccr" in s:
        rows.append(("measured CCR (auto ratio)", f"{s['ccr']:.3f}"))
    if "bucket_cap_mb" in s:
        rows.append(("DDP bucket_cap_mb", f"{s['bucket_cap_mb']:g} MB"))
    if "bucket_warning" in s:
        rows.append(("warning", s["bucket_warning"]))
    if "stragglers" in s:
        rows.append(("stragglers (per-rank compute, link probe)", s["stragglers"]["note"]))
    return rows


def print_summary(result: dict[str, Any]) -> None:
    """Print the summary table of one run to the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gradsync train: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary_rows(result["summary"]):
        table.add_row(k, v)
    console = Console()
    Console(width=max(console.width, 130)).print(table)


def write_outputs(result: dict[str, Any], out: str | Path) -> tuple[Path, Path | None]:
    """Write ``metrics.json`` (config, summary, per-iteration and per-epoch records) and
    ``curves.png`` (training loss and test accuracy against wall-clock seconds) into ``out``; the
    figure's path is ``None`` where matplotlib (the ``bench`` extra) is missing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.json"
    metrics.write_text(json.dumps(result, indent=1, default=str))
    plt = pyplot("curves.png")
    if plt is None:
        return metrics, None

    its, eps = result["iterations"], result["epochs"]
    adaptive = [i for i in its if "compression_factor" in i]
    fig, axes = plt.subplots(1, 3 if adaptive else 2, figsize=(15 if adaptive else 10, 4))
    ax1, ax2 = axes[0], axes[1]
    ax1.plot([i["wall_s"] for i in its], [i["loss"] for i in its], lw=0.6, alpha=0.5, label="per step")
    window = max(1, len(its) // 50)
    if len(its) >= window:
        smooth = [sum(i["loss"] for i in its[k - window:k]) / window for k in range(window, len(its) + 1)]
        ax1.plot([its[k - 1]["wall_s"] for k in range(window, len(its) + 1)], smooth, lw=1.5,
                 label=f"mean of {window}")
    ax1.set_xlabel("wall-clock time (s)")
    ax1.set_ylabel("training loss")
    ax1.set_yscale("log")
    ax1.legend()
    ax2.plot([e["wall_s"] for e in eps], [e["test_acc"] * 100 for e in eps], "o-")
    ax2.set_xlabel("wall-clock time (s)")
    ax2.set_ylabel("test accuracy (%)")
    if adaptive:
        axes[2].step([i["wall_s"] for i in adaptive], [i["compression_factor"] for i in adaptive], where="post")
        axes[2].set_yscale("log")
        axes[2].set_xlabel("wall-clock time (s)")
        axes[2].set_ylabel("compression factor chosen (x)")
    s = result["summary"]
    fig.suptitle(f"{s['algorithm']} on {result['config']['workload']}, world size {s['world_size']}")
    fig.tight_layout()
    curves = out / "curves.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    return metrics, curves
