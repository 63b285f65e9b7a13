"""Terminal table, ``bench.json`` and PNG plots of a ``gradsync bench`` run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..extras import pyplot
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
        table.add_column(col, justify="left" if col == "algorithm" else "right",
                         overflow="fold" if col == "algorithm" else "ellipsis")
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
    seconds, one line per algorithm and seed), with ``--to-quality`` data ``quality.png`` (quality against
    training seconds, one line per entry and seed, the target dashed) and, when a row logs COVAP's ratio
    per step (``covap_k``), ``ratio.png`` (K per timed step, rounds one after another); only the JSON where matplotlib (the ``bench`` extra) is missing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json"]
    paths[0].write_text(json.dumps(result, indent=1))
    plt = pyplot("bench figures")
    if plt is None:
        return paths
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
    paths.append(_save(fig, ax, out / "breakdown.png"))
    if any("time_to_accuracy" in r for r in rows):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, r in enumerate(rows):
            tta = r.get("time_to_accuracy", {})
            for j, curve in enumerate(tta.get("curves") or [tta.get("curve", [])]):
                if curve:  # one line per seed, the first labelled
                    ax.plot([c[0] for c in curve], [c[1] * 100 for c in curve], "o-", ms=3, color=f"C{i}",
                            alpha=1.0 if j == 0 else 0.45, label=r["algorithm"] if j == 0 else None)
        ax.axhline(result["config"]["to_accuracy"] * 100, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("training wall-clock time (s, evaluation excluded)")
        ax.set_ylabel("test accuracy (%)")
        paths.append(_save(fig, ax, out / "accuracy.png"))
    if "quality" in result:
        paths.append(plot_quality(result["quality"], out / "quality.png",
                                  "training wall-clock time (s, evaluation excluded)"))
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
        paths.append(_save(fig, ax, out / "ratio.png"))
    return paths


def plot_quality(quality: dict[str, Any], path: Path, xlabel: str, title: str | None = None) -> Path | None:
    """Quality against seconds, one line per entry and seed (the first seed labelled), the target
    dashed, written to ``path`` (PNG).

    Args:
        quality: ``"curves"`` (entry -> per seed ``[[steps, seconds, quality], ...]``), ``"target"``,
            ``"metric"`` and ``"higher_is_better"``, as in ``gradsync bench --to-quality``'s result or a
            sweep's prediction (:func:`gradsync.bench.sweep.predict`).
        path: the PNG file.
        xlabel: what the seconds are (measured wall-clock, predicted on a network).
        title: the figure's title, if any.

    Returns:
        ``path``, or None where matplotlib (the ``bench`` extra) is missing.
    """
    plt = pyplot("quality figures")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    scale = 100 if quality["higher_is_better"] else 1
    for i, (name, per_seed) in enumerate(quality["curves"].items()):
        for j, curve in enumerate(per_seed):
            ax.plot([c[1] for c in curve], [c[2] * scale for c in curve], "o-", ms=3, color=f"C{i}",
                    alpha=1.0 if j == 0 else 0.45, label=name if j == 0 else None)
    ax.axhline(quality["target"] * scale, color="grey", ls="--", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{quality['metric']}" + (" (%)" if quality["higher_is_better"] else ""))
    if title:
        ax.set_title(title, fontsize=9)
    return _save(fig, ax, path)


def _save(fig: Any, ax: Any, path: Path) -> Path:
    """Add the legend, lay out, write ``fig`` to ``path`` (PNG, 110 dpi), close it; returns ``path``."""
    plt = pyplot(str(path))

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per algorithm for the time-to-accuracy report (``gradsync bench --table accuracy``):
    ``algorithm``, ``options`` (what ``auto`` chose, e.g. ``K=4``), ``seconds`` to the target test
    accuracy (None when not reached), ``steps`` trained, ``final_accuracy`` (0-1, the last
    evaluation), ``iteration_ms`` (median), ``scaling_efficiency`` (0-1), ``wire_bytes_per_iteration``
    (per rank) and ``speedup``: all-reduce's time to the target over this algorithm's (None when
    either did not reach it; the iteration-time speed-up is ``iteration_speedup``).

    Raises:
        ValueError: if the run has no time-to-accuracy data (``--to-accuracy`` not given).
    """
    rows = result["rows"]
    if not any("time_to_accuracy" in r for r in rows):
        raise ValueError("table 'accuracy' needs --to-accuracy (a target test accuracy, 0-1)")
    tta = {r["algorithm"]: r.get("time_to_accuracy", {}) for r in rows}
    base = tta.get("allreduce", tta[rows[0]["algorithm"]]).get("seconds")
    out = []
    for r in rows:
        t = tta[r["algorithm"]]
        by_seed = t.get("seconds_by_seed", [t.get("seconds")])
        opts = r.get("options", {})
        shown = {"ratio": "K", "cast": "cast", "density": "density", "matrix_approximation_rank": "r"}
        out.append({
            "algorithm": r["algorithm"],
            "options": ", ".join(f"{shown[k]}={opts[k]}" for k in shown if opts.get(k) is not None),
            "seconds": t.get("seconds"),
            "steps": t.get("steps"),
            "final_accuracy": (statistics.median(t["final_accuracy_by_seed"]) if t.get("final_accuracy_by_seed")
                               else t["curve"][-1][1] if t.get("curve") else None),
            "seeds": len(by_seed),
            "reached": sum(x is not None for x in by_seed),
            "seconds_range": _range(by_seed),
            "iteration_ms": r["iteration_s"]["median"] * 1e3,
            "scaling_efficiency": r["scaling_efficiency"],
            "wire_bytes_per_iteration": r["wire_bytes_per_iteration"],
            "iteration_speedup": r["speedup_vs_allreduce"],
            "speedup": (base / t["seconds"]) if base and t.get("seconds") else None,
        })
    return out


def _range(values: list[float | None]) -> tuple[float | None, float | None]:
    reached = [v for v in values if v is not None]
    return (min(reached) if reached else None,
            None if len(reached) < len(values) or not reached else max(reached))


def time_to_target_cell(r: dict[str, Any]) -> str:
    """An :func:`accuracy_rows` row's time to the target as text: ``"53.4 (275 steps)"`` or ``"not
    reached"``, with several seeds followed by ``[fastest-slowest, reached/seeds reached]``."""
    if r["seconds"] is None:
        text = "not reached"
    else:
        text = f"{r['seconds']:.1f} ({r['steps']:g} steps)"
    if r["seeds"] > 1:
        lo, hi = r["seconds_range"]
        text += (f" [{'-' if lo is None else f'{lo:.1f}'}-{'not reached' if hi is None else f'{hi:.1f}'}, "
                 f"{r['reached']}/{r['seeds']} reached]")
    return text


def print_accuracy_table(result: dict[str, Any], label: str) -> None:
    """Print the time-to-accuracy story as one table: per algorithm the time to the target test
    accuracy (s), the accuracy at the last evaluation, median iteration time (ms), scaling
    efficiency, wire bytes per rank per iteration and the speed-up in time to the target over all-reduce
    (see :func:`accuracy_rows`).

    Raises:
        ValueError: if the run has no time-to-accuracy data.
    """
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    target = cfg["to_accuracy"] * 100
    table = Table(title=f"gradsync bench: time to {target:.0f}% test accuracy, {result['world_size']} ranks, {label}",
                  caption=(f"{cfg['workload']}, batch {cfg['batch_size']} per rank, lr {cfg['lr']:g}; test accuracy "
                           + (f"on the first {cfg['eval_samples']:,} test samples" if cfg.get("eval_samples")
                              else "on the full test set")
                           + f" every {cfg['eval_every']} steps (evaluation time excluded); "
                           + (f"median over seeds {', '.join(map(str, cfg['seeds']))} (fastest-slowest); "
                              if len(cfg.get("seeds") or []) > 1 else "")
                           + f"dense all-reduce CCR {result['dense_ccr']:.2f}; iteration times: medians of "
                           f"{cfg['rounds']} x {cfg['steps']} interleaved steps"))
    for col in ("algorithm", f"time to {target:.0f}% (s)", "final accuracy", "iteration ms", "scaling eff.",
                "wire/iter", "speed-up"):
        table.add_column(col, justify="left" if col == "algorithm" else "right",
                         overflow="fold" if col == "algorithm" else "ellipsis")
    for r in accuracy_rows(result):
        name = r["algorithm"] + (f" ({r['options']})" if r["options"] else "")
        table.add_row(name, time_to_target_cell(r),
                      "-" if r["final_accuracy"] is None else f"{r['final_accuracy'] * 100:.1f}%",
                      f"{r['iteration_ms']:.1f}", f"{r['scaling_efficiency'] * 100:.0f}%",
                      fmt_bytes(r["wire_bytes_per_iteration"]),
                      "-" if r["speedup"] is None else f"{r['speedup']:.2f}x")
    Console(width=max(Console().width, 130)).print(table)


def _quality_text(value: float | None, higher_is_better: bool) -> str:
    """A quality as text: accuracy (0-1) as a percentage, bits per character with 4 decimals."""
    if value is None:
        return "-"
    return f"{value * 100:.2f}%" if higher_is_better else f"{value:.4f}"


def _wins_text(wins: dict[str, list[int]]) -> str:
    """``{"fp16": [0, 2], "powersgd": []}`` as ``"fp16 on 0,2"`` (entries with no win left out)."""
    return "; ".join(f"{other} on {','.join(map(str, seeds))}" for other, seeds in wins.items() if seeds) or "-"


def print_quality_table(result: dict[str, Any], label: str) -> None:
    """Print the ``--to-quality`` summary (:func:`gradsync.bench.quality.summarise_quality`): per entry
    the mean final quality, the seconds to the target per seed ("-" where not reached), the olympic
    mean over >= 5 seeds (with fewer: "needs 5 seeds"), the median and spread (fastest-slowest) of the
    seconds to the target, the median iteration time of the timed rounds (ms) and the seeds on which
    it reached the target before each other entry.

    Raises:
        ValueError: if the run has no ``--to-quality`` data.
    """
    from rich.console import Console
    from rich.table import Table

    q = result.get("quality")
    if q is None:
        raise ValueError("table 'quality' needs --to-quality")
    cfg, hib = result["config"], q["higher_is_better"]
    target = _quality_text(q["target"], hib)
    where = (f"dense ({q['target_from']}) mean final {'- 0.5 points' if hib else '+ 0.5 %'}"
             if q["target_from"] != "absolute" else "absolute")
    table = Table(title=f"gradsync bench: time to {q['metric']} {target} ({where}), {result['world_size']} ranks, "
                        f"{label}",
                  caption=(f"{cfg['workload']}: {q['budget_steps']} steps ({q['epochs']} epochs of "
                           f"{q['train_samples']:,} samples), batch {cfg['batch_size']} per rank, one-cycle lr peak "
                           f"{cfg['lr']:g}, warm-up {q['warmup_fraction']:g}; {q['metric']} on "
                           + (f"the first {cfg['eval_samples']:,} test samples" if cfg.get("eval_samples")
                              else "the full test set")
                           + f" every {cfg['eval_every']} steps and at the end; seconds: training wall-clock "
                           f"without evaluation; seeds {', '.join(map(str, q['seeds']))}"))
    for col in ("entry", "final (mean)", "s to target per seed", "olympic mean s", "median s", "spread s",
                "iteration ms", "first to target vs"):
        table.add_column(col, justify="left" if col in ("entry", "first to target vs") else "right",
                         overflow="fold")
    iteration = {r["algorithm"]: r["iteration_s"]["median"] for r in result["rows"]}

    def secs(v: float | None) -> str:
        return "not reached" if v is None else f"{v:.1f}"

    for name, e in q["entries"].items():
        olympic = (secs(e["olympic_mean_s"]) if len(q["seeds"]) >= 5 else "needs 5 seeds")
        lo, hi = e["spread_s"]
        table.add_row(name, _quality_text(e["final_mean"], hib), "/".join(secs(s) for s in e["seconds_by_seed"]),
                      olympic, secs(e["median_s"]), f"{secs(lo)}-{secs(hi)}",
                      f"{iteration[name] * 1e3:.1f}" if name in iteration else "-", _wins_text(e["wins"]))
    Console(width=max(Console().width, 130)).print(table)
