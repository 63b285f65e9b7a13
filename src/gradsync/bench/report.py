"""Terminal table, ``bench.json`` and PNG plots of a ``gradsync bench`` run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..report.training import fmt_bytes


def print_table(result: dict[str, Any], label: str) -> None:
    """Print one row per algorithm: iteration-time median and p10/p90 (ms), speedup against
    all-reduce, scaling efficiency, exposed communication and compression overhead (ms), entropy-coding
    time per iteration (ms, part of the compression overhead; shown when an algorithm codes, e.g.
    ``oscar-asc``), wire bytes per rank per iteration (what the rank puts on the network:
    :func:`gradsync.comm.collectives.wire_bytes`), the compression ratio on wire bytes (dense ring
    all-reduce wire bytes / wire bytes), payload bytes per rank per iteration (the tensors handed to
    the collectives), and time to accuracy when measured."""
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=f"gradsync bench: {result['world_size']} ranks, {label}",
                  caption=(f"compute-only {result['compute_only_s'] * 1e3:.1f} ms/iter (all ranks at once); "
                           f"dense all-reduce {result['dense_allreduce_s'] * 1e3:.1f} ms, "
                           f"CCR {result['dense_ccr']:.2f}; "
                           + "".join(f"{n}: {', '.join(f'{k} = {v}' for k, v in c.items() if k != 'ccr')}; "
                                     for n, c in result["chosen_from_ccr"].items())
                           + f"{cfg['rounds']} rounds x {cfg['steps']} steps, interleaved"))
    for col in ("algorithm", "median ms", "p10-p90 ms", "speedup", "scaling eff.", "exposed comm ms",
                "compress ms", "wire/iter", "ratio", "payload/iter"):
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    has_coding = any(r.get("coding_s", 0.0) > 0 for r in result["rows"])
    if has_coding:
        table.add_column("coding ms", justify="right")
    has_tta = any("time_to_accuracy" in r for r in result["rows"])
    if has_tta:
        table.add_column(f"time to {cfg['to_accuracy'] * 100:.0f}% (s)", justify="right")
    for r in result["rows"]:
        it = r["iteration_s"]
        cells = [r["algorithm"], f"{it['median'] * 1e3:.1f}", f"{it['p10'] * 1e3:.0f}-{it['p90'] * 1e3:.0f}",
                 f"{r['speedup_vs_allreduce']:.2f}x", f"{r['scaling_efficiency'] * 100:.0f}%",
                 f"{r['exposed_comm_s'] * 1e3:.1f}", f"{r['compression_overhead_s'] * 1e3:.1f}",
                 fmt_bytes(r["wire_bytes_per_iteration"]), f"{r['compression_ratio']:.2f}x",
                 fmt_bytes(r["payload_bytes_per_iteration"])]
        if has_coding:
            cells.append(f"{r.get('coding_s', 0.0) * 1e3:.1f}")
        if has_tta:
            tta = r.get("time_to_accuracy", {}).get("seconds")
            cells.append("not reached" if tta is None else f"{tta:.1f}")
        table.add_row(*cells)
    console = Console()
    Console(width=max(console.width, 130)).print(table)


def write_outputs(result: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``bench.json``, ``breakdown.png`` (stacked compute / compression / exposed communication
    per algorithm), with time-to-accuracy data ``accuracy.png`` (test accuracy against training
    seconds) and, when a row logs COVAP's ratio per step (``covap_k``), ``ratio.png`` (K per timed
    step, rounds one after another)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json"]
    paths[0].write_text(json.dumps(result, indent=1))
    rows = result["rows"]
    names = [r["algorithm"] for r in rows]
    compute = [result["compute_only_s"] * 1e3] * len(rows)
    compress = [r["compression_overhead_s"] * 1e3 for r in rows]
    exposed = [r["exposed_comm_s"] * 1e3 for r in rows]
    measured = [r["iteration_s"]["median"] * 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 3, 4))
    ax.bar(names, compute, label="compute (fwd+bwd+step)")
    ax.bar(names, compress, bottom=compute, label="compression")
    ax.bar(names, exposed, bottom=[a + b for a, b in zip(compute, compress)], label="exposed communication")
    ax.scatter(names, measured, color="black", zorder=3, label="measured median")
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"iteration-time breakdown, {result['world_size']} ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "breakdown.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if any("time_to_accuracy" in r for r in rows):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in rows:
            curve = r.get("time_to_accuracy", {}).get("curve", [])
            if curve:
                ax.plot([c[0] for c in curve], [c[1] * 100 for c in curve], "o-", ms=3, label=r["algorithm"])
        ax.axhline(result["config"]["to_accuracy"] * 100, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("training wall-clock time (s, evaluation excluded)")
        ax.set_ylabel("test accuracy (%)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "accuracy.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if any(r.get("covap_k") for r in rows):
        steps = result["config"]["steps"]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for r in rows:
            ks = r.get("covap_k")
            if ks:
                ax.step(range(1, len(ks) + 1), ks, where="post", label=r["algorithm"])
        for b in range(steps, max(len(r.get("covap_k") or []) for r in rows), steps):
            ax.axvline(b + 0.5, color="grey", ls=":", lw=0.8)  # a new round starts from the start-up K
        ax.set_xlabel("timed step (rounds one after another)")
        ax.set_ylabel("COVAP ratio K")
        ax.set_title("COVAP's K per step")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "ratio.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
