"""Cheap sweeps of time to quality: steps on loopback, iteration time on each network.

Steps to a quality target depend on the algorithm and the seed (the arithmetic), not on the network:
on loopback and on a shaped link the same collectives sum the same numbers in the same order, so the
curves are equal step for step (adaptive settings that read wall-clock time, such as GraVAC or
COVAP's ``ratio=auto`` with ``adapt_every``, are the exception). Iteration time depends on the
network. ``gradsync sweep`` therefore trains every entry to quality once per seed on loopback
(``gradsync bench --to-quality``, one bench per entry, the dense one first: its mean final quality
sets the target the others are gated on), times every entry on each emulated network (``gradsync
bench`` without ``--to-quality``), and predicts

    time to quality on network N = steps to the target (loopback) x mean iteration time on N

per seed, summarised as a measured run is (:func:`gradsync.bench.quality.summarise_quality`: olympic
mean, median, spread, wins). An entry with a dense tail (``dense_from=D``: covap, powersgd) runs two
phases at two speeds, so the timing runs also time it with ``dense_from`` at the first compressed
iteration (:func:`tail_timing_entry`: every timed step in the tail), and its time to ``s`` steps is
``min(s, D) x`` the entry's iteration time ``+ max(0, s - D) x`` the tail's. :func:`validate` compares a prediction with a full shaped run; the
prediction holds where every seed's error is within :data:`TOLERANCE`.

Every sub-run writes ``bench.json`` under its own folder of the sweep's output together with the
``gradsync bench`` arguments that made it; a later sweep with the same arguments reuses it, so an
interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from ..algorithms import dense_tail_seconds, split_dense_tail
from .quality import OLYMPIC_MIN_SEEDS, default_target, summarise_quality

__all__ = ["TOLERANCE", "auto_label", "merge_quality", "predict", "validate", "slug", "run_or_reuse", "dense_tail",
           "tail_timing_entry"]

#: Largest relative error of a predicted time to quality that counts as "holds" (10 %).
TOLERANCE = 0.10
#: The first compressed iteration of covap and powersgd (their ``start_iter``): a timing run of an entry
#: with ``dense_from`` there has every timed step (after ``gradsync bench``'s warm-up) in the dense tail.
TAIL_TIMING_FROM = 2


def dense_tail(entry: str) -> int:
    """The ``dense_from`` option of a ``--algorithms`` entry (``powersgd:matrix_approximation_rank=4:dense_from=700``
    -> 700): the iteration its dense tail starts; 0 without one.

    Raises:
        ValueError: if the entry's ``dense_from`` is not an integer.
    """
    return split_dense_tail(entry)[1]


def tail_timing_entry(entry: str) -> str:
    """``entry`` with ``dense_from`` at :data:`TAIL_TIMING_FROM`: a timing run of it times the dense tail.

    Raises:
        ValueError: if ``entry`` has no dense tail.
    """
    base, tail = split_dense_tail(entry)
    if not tail:
        raise ValueError(f"algorithms entry {entry!r} has no dense tail (dense_from)")
    return f"{base}:dense_from={TAIL_TIMING_FROM}"


def timed_entries(entries: list[str]) -> list[str]:
    """``entries`` plus the :func:`tail_timing_entry` of each one with a dense tail (once each)."""
    tails = [tail_timing_entry(e) for e in entries if e != "auto" and dense_tail(e)]
    return list(dict.fromkeys([*entries, *tails]))


def slug(text: str) -> str:
    """A folder name for a ``--algorithms`` entry or a network: ``covap:ratio=2:cast=fp16`` ->
    ``covap_ratio-2_cast-fp16``."""
    return text.replace(":", "_").replace("=", "-").replace(",", "+").replace("/", "-")


def merge_quality(results: list[dict[str, Any]], dense: Optional[str] = "allreduce",
                  target: Optional[float] = None) -> dict[str, Any]:
    """One ``--to-quality`` summary from several ``gradsync bench --to-quality`` results (each a parsed
    ``bench.json``; one entry each in a sweep), recomputed over all their curves.

    Args:
        results: bench results with a ``"quality"`` section, trained with the same seeds, metric and
            budget.
        dense: the entry whose mean final quality sets the target when ``target`` is None.
        target: an absolute target.

    Returns:
        :func:`~gradsync.bench.quality.summarise_quality`'s dict plus ``"curves"``, ``"metric"``,
        ``"budget_steps"``, ``"world_size"`` and ``"workload"``.

    Raises:
        ValueError: if ``results`` is empty, a result has no quality section, or they differ in seeds,
            metric, budget or world size, or an entry appears twice.
    """
    if not results:
        raise ValueError("results must hold at least one gradsync bench --to-quality result")
    curves: dict[str, Any] = {}
    first = None
    for r in results:
        q = r.get("quality")
        if q is None:
            raise ValueError("every result must come from gradsync bench --to-quality (no 'quality' section)")
        key = (q["seeds"], q["metric"], q["budget_steps"], r["world_size"], r["config"]["workload"])
        if first is None:
            first = key
        elif key != first:
            raise ValueError(f"results must share seeds, metric, budget, world size and workload; got {key} and {first}")
        for name, c in q["curves"].items():
            if name in curves:
                raise ValueError(f"entry {name!r} appears in more than one result")
            curves[name] = c
    seeds, metric, budget, world, workload = first
    higher = results[0]["quality"]["higher_is_better"]
    summary = summarise_quality(curves, seeds, higher, target, dense)
    return {**summary, "curves": curves, "metric": metric, "budget_steps": budget, "world_size": world,
            "workload": workload}


def iteration_seconds(timing: dict[str, Any]) -> dict[str, float]:
    """Mean iteration time (seconds) per entry of a ``gradsync bench`` result: a run's training time is
    the sum of its steps, and iteration times on a shaped link are skewed to the right (p90 up to 1.5x
    the median at 5 Mbit/s), so the median would under-predict it."""
    return {r["algorithm"]: r["iteration_s"]["mean"] for r in timing["rows"]}


def predict(quality: dict[str, Any], timing: dict[str, Any], auto_job: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Predicted time to quality on ``timing``'s network.

    Args:
        quality: :func:`merge_quality` of the loopback runs (or one bench's ``"quality"`` section).
        timing: a ``gradsync bench`` result on the network (``rows`` with mean ``iteration_s``); it
            must time every entry of ``quality`` with the same world size.
        auto_job: the ``"quality"`` section of a ``--to-quality`` run of ``auto`` alone on this network
            (``--auto-probe online``: every seed a job that decided on its own steps): its measured curves
            (training seconds from the job's start-up on) stand for ``auto`` in place of a prediction.

    Returns:
        :func:`~gradsync.bench.quality.summarise_quality` of the curves with every point's seconds
        replaced by ``steps x iteration_s`` (for an entry with a dense tail from iteration D:
        ``min(steps, D) x iteration_s + max(0, steps - D) x`` its :func:`tail_timing_entry`'s; the
        target kept), plus those ``"curves"`` (entry -> per seed ``[[steps, predicted seconds,
        quality], ...]``), ``"iteration_s"`` per entry (``"tail_iteration_s"``: the dense tail's, per entry
        with one),
        ``"network"``, ``"dense_ccr"`` and ``"speedup_vs_dense"`` per entry (dense's olympic mean, or
        median with fewer than 5 seeds, over the entry's; None where either is missing, as when a
        seed the olympic mean keeps did not reach the target).

    An ``auto`` row of ``timing`` (the entry :mod:`gradsync.profiler.auto` chose on that network) is
    predicted with the steps of the entry it chose and its own iteration time (the tail's of the entry it
    chose, if that has a dense tail), plus the seconds auto spent measuring on that network
    (``probe_seconds``); ``"auto_choice"`` names
    the entry (None without an auto row; an ``auto`` whose choice was not swept is left out, named in
    ``"auto_not_swept"``). With ``auto_job`` its own measured curves are ``auto``'s instead, ``"auto_choices"``
    names each seed's choice and ``"auto_choice"`` the most frequent of them.

    Raises:
        ValueError: if ``timing`` lacks an entry of ``quality`` (or the tail timing of one with a dense
            tail) or its world size differs.
    """
    it = iteration_seconds(timing)
    # the entry auto's timing round chose, whose curves and steps stand for auto's (none where auto ran as jobs)
    timed_choice = (timing.get("chosen_from_ccr", {}).get("auto", {}).get("entry")
                    if "auto" in it and auto_job is None else None)
    choices = [d and d.get("auto_choice") for d in (auto_job or {}).get("auto_decisions", [])]
    auto_choice = Counter(choices).most_common(1)[0][0] if choices else timed_choice
    if auto_job is not None:
        quality = {**quality, "curves": {**quality["curves"], "auto": auto_job["curves"]["auto"]}}
    elif timed_choice is not None and timed_choice in quality["curves"] and "auto" not in quality["curves"]:
        quality = {**quality, "curves": {**quality["curves"], "auto": quality["curves"][timed_choice]}}
    chosen = {name: timed_choice if name == "auto" and timed_choice else name for name in quality["curves"]}
    missing = sorted(set(timed_entries(list(chosen.values()))) - set(it))
    if missing:
        raise ValueError(f"timing must time every entry of the sweep; missing: {', '.join(missing)}")
    if "world_size" in quality and timing["world_size"] != quality["world_size"]:
        raise ValueError(f"timing's world size ({timing['world_size']}) must equal the quality runs' "
                         f"({quality['world_size']})")

    probe_s = timing.get("chosen_from_ccr", {}).get("auto", {}).get("probe_seconds") or 0.0

    def seconds(name: str, steps: float) -> float:
        tail_s = it[tail_timing_entry(chosen[name])] if dense_tail(chosen[name]) else None
        return dense_tail_seconds(chosen[name], steps, it[name], tail_s) + (probe_s if name == "auto" else 0.0)

    curves = {name: [[[p[0], p[1] if name == "auto" and auto_job is not None else seconds(name, p[0]), p[2]]
                      for p in c] for c in per_seed]
              for name, per_seed in quality["curves"].items()}
    out = summarise_quality(curves, quality["seeds"], quality["higher_is_better"], quality["target"])
    out["target_from"] = quality["target_from"]
    dense = quality["target_from"] if quality["target_from"] in curves else "allreduce"
    out["speedup_vs_dense"] = {name: _ratio(out["entries"].get(dense), e) for name, e in out["entries"].items()}
    out.update(curves=curves, iteration_s={n: it[n] for n in curves},
               tail_iteration_s={n: it[tail_timing_entry(chosen[n])] for n in curves if dense_tail(chosen[n])},
               network=timing.get("network"),
               dense_ccr=timing.get("dense_ccr"), auto_choice=auto_choice,
               auto_not_swept=auto_choice if auto_choice is not None and "auto" not in curves else None)
    if auto_job is not None:
        out.update(auto_choices=choices, auto_decisions=auto_job.get("auto_decisions"))
    return out


def auto_label(pred: dict[str, Any]) -> str:
    """The ``auto`` row's name in a :func:`predict` table: ``auto (chose E)``; where auto ran as jobs, the
    choices of its seeds (``auto (jobs chose E on 4 of 5 seeds, F on 1)``)."""
    choices = pred.get("auto_choices")
    if not choices:
        return f"auto (chose {pred['auto_choice']})"
    (first, n), *rest = Counter(choices).most_common()
    return (f"auto (jobs chose {first} on {n} of {len(choices)} seeds"
            + "".join(f", {c} on {k}" for c, k in rest) + ")")


def _headline(e: dict[str, Any]) -> Optional[float]:
    """An entry's summary seconds: the olympic mean with >= 5 seeds (None when a kept seed did not
    reach the target), the median with fewer."""
    return e["olympic_mean_s"] if len(e["seconds_by_seed"]) >= OLYMPIC_MIN_SEEDS else e["median_s"]


def _ratio(dense: Optional[dict[str, Any]], e: dict[str, Any]) -> Optional[float]:
    if dense is None or _headline(dense) is None or _headline(e) is None:
        return None
    return _headline(dense) / _headline(e)


def validate(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Compare a prediction (:func:`predict`) with a full shaped ``--to-quality`` run on the same network
    (its ``"quality"`` section, same target: run it with ``--quality-target``).

    Returns:
        ``{"target", "rows": [{"entry", "seed", "predicted_s", "measured_s", "error"}], "max_error",
        "holds"}``: ``error`` is ``predicted / measured - 1`` (None where either did not reach the
        target; a seed reached in one and not the other counts as not holding), ``holds`` whether
        every row is within :data:`TOLERANCE`.

    Raises:
        ValueError: if the targets differ or the measured run has an entry or seed the prediction lacks.
    """
    if not math.isclose(predicted["target"], measured["target"], rel_tol=1e-9):
        raise ValueError(f"measured run's target ({measured['target']}) must equal the prediction's "
                         f"({predicted['target']}): run it with --quality-target")
    rows, holds = [], True
    for name, m in measured["entries"].items():
        if name not in predicted["entries"]:
            raise ValueError(f"measured entry {name!r} is not in the prediction")
        p = predicted["entries"][name]
        for seed, ms in zip(measured["seeds"], m["seconds_by_seed"]):
            if seed not in predicted["seeds"]:
                raise ValueError(f"measured seed {seed} is not in the prediction")
            ps = p["seconds_by_seed"][predicted["seeds"].index(seed)]
            error = None if ps is None or ms is None else ps / ms - 1
            holds &= (ps is None and ms is None) or (error is not None and abs(error) <= TOLERANCE)
            rows.append({"entry": name, "seed": seed, "predicted_s": ps, "measured_s": ms, "error": error})
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    return {"target": measured["target"], "rows": rows, "max_error": max(errors) if errors else None,
            "holds": holds and bool(rows)}


def run_or_reuse(folder: Path, argv: list[str], run: Callable[[list[str]], int]) -> dict[str, Any]:
    """``folder/bench.json`` when ``folder/argv.json`` records exactly ``argv``; otherwise
    ``run(argv + ["--out", folder])`` (``gradsync bench``'s entry point) and then its result.

    Raises:
        RuntimeError: if the bench fails (its exit status is not 0).
    """
    folder = Path(folder)
    record, result = folder / "argv.json", folder / "bench.json"
    if record.exists() and result.exists() and json.loads(record.read_text()) == argv:
        print(f"sweep: reusing {result} ({' '.join(argv)})", flush=True)
        return json.loads(result.read_text())
    rc = run(argv + ["--out", str(folder)])
    if rc != 0:
        raise RuntimeError(f"gradsync {' '.join(argv)} failed with exit status {rc}")
    record.write_text(json.dumps(argv))
    return json.loads(result.read_text())


def dense_target(dense_result: dict[str, Any]) -> float:
    """The default target from a dense entry's ``--to-quality`` bench: its mean final quality minus
    0.5 points (accuracy) or plus 0.5 % (bits per character)."""
    q = dense_result["quality"]
    name = next(iter(q["entries"]))
    return default_target(q["entries"][name]["final_by_seed"], q["higher_is_better"])


def summary_rows(predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per entry of a prediction, fastest first: entry, iteration ms (and its dense tail's, None
    without one), median steps to the target, predicted olympic mean (or median) seconds, speed-up over
    dense, seeds reached."""
    rows = []
    tails = predicted.get("tail_iteration_s", {})
    for name, e in predicted["entries"].items():
        steps = [s for s in e["steps_by_seed"] if s is not None]
        rows.append({"entry": name, "iteration_ms": predicted["iteration_s"][name] * 1e3,
                     "tail_iteration_ms": tails[name] * 1e3 if name in tails else None,
                     "median_steps": statistics.median(steps) if steps else None,
                     "predicted_s": _headline(e), "speedup": predicted["speedup_vs_dense"][name],
                     "reached": e["reached"], "final_mean": e["final_mean"]})
    return sorted(rows, key=lambda r: math.inf if r["predicted_s"] is None else r["predicted_s"])


#: ``gradsync bench`` flags a sweep forwards to every sub-run (model, data and recipe), and those it
#: forwards to the to-quality runs only.
MODEL_FLAGS = ("workload", "model", "batch_size", "lr", "bucket_cap_mb", "data_dir")
QUALITY_FLAGS = ("epochs", "train_samples", "eval_every", "eval_samples")
#: the budget's flags, forwarded to the timing runs too: ``auto`` there sets a dense tail's start from it
BUDGET_FLAGS = ("epochs", "train_samples")
#: flags forwarded to the timing runs only (how ``auto`` measures)
TIMING_FLAGS = ("auto_probe",)


def _flags(values: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    return [x for k in keys if values.get(k) is not None for x in (f"--{k.replace('_', '-')}", str(values[k]))]


def run_sweep(entries: list[str], seeds: list[int], hosts: int, bandwidths: list[float], out: Path,
              values: dict[str, Any], run: Callable[[list[str]], int], steps: int = 20, warmup: int = 5,
              rounds: int = 2, quality_target: Optional[float] = None,
              validate_at: Optional[tuple[float, list[str], list[int]]] = None) -> dict[str, Any]:
    """Run (or reuse) the sub-benches of a sweep and predict time to quality on every network.

    Args:
        entries: ``--algorithms`` entries; ``allreduce`` must be one unless ``quality_target`` is given.
            ``auto`` is timed on every network and predicted with the steps of the entry it chose
            there (which must be among ``entries``), not trained on loopback (where it would choose
            for loopback); with ``values["auto_probe"] == "online"`` it is trained as a job on every
            network instead (a shaped ``--to-quality`` run of ``auto`` alone, every seed deciding on its own
            steps, in ``auto-<hosts>x<rate>mbit/``), and its measured seconds stand.
        seeds: seeds of the to-quality runs (>= 5 for olympic means).
        hosts: ranks (emulated hosts, one rank each), >= 2.
        bandwidths: the networks' link rates, Mbit/s.
        out: the sweep's folder (``quality/<entry>/``, ``network-<hosts>x<rate>/``, ``validate-.../``).
        values: :data:`MODEL_FLAGS`, :data:`QUALITY_FLAGS` and :data:`TIMING_FLAGS` values (None: the bench
            default).
        run: ``gradsync``'s entry point (``gradsync.cli.main``), called with a bench argv.
        steps, warmup, rounds: the timing benches' iterations.
        quality_target: an absolute target; None: dense's mean final minus 0.5 points.
        validate_at: ``(rates, entries, seeds)``: a full shaped to-quality run of ``entries`` and
            ``seeds`` at each of ``rates`` (among ``bandwidths``) to check the prediction there; ``auto``
            among them measures as in the timing runs (``--auto-probe``), its jobs run seed by seed
            beside the others' (the target is given), so auto and a fixed setting are compared on the
            same stretch of the machine's time.

    Returns:
        ``{"quality": merge_quality(...), "networks": {rate: predict(...)}, "validation": [validate(...)
        with "bandwidth_mbit", one per validation rate], "hosts"}``, also written to ``out/sweep.json``.

    Raises:
        ValueError: naming entries (no allreduce without a target), bandwidths (empty, or a validation
            rate not among them) or hosts (< 2).
        RuntimeError: if a sub-run fails, or a timing run was not shaped (not root: no emulated cluster).
    """
    if hosts < 2:
        raise ValueError(f"hosts must be an integer in [2, 64]; got {hosts}")
    if not bandwidths:
        raise ValueError("bandwidths must give at least one rate in Mbit/s")
    if quality_target is None and "allreduce" not in entries:
        raise ValueError("entries must include allreduce (its final quality sets the target) or give quality_target")
    if validate_at is not None and not set(validate_at[0]) <= set(bandwidths):
        raise ValueError(f"the validation rates {validate_at[0]} must be among bandwidths {bandwidths}")
    out = Path(out)
    model, qual = _flags(values, MODEL_FLAGS), _flags(values, QUALITY_FLAGS)
    budget = _flags(values, BUDGET_FLAGS)  # auto scales a dense tail's start to the budget
    short = ["--steps", "3", "--warmup", "1", "--rounds", "1"]

    def quality_run(entry: str, target: Optional[float], folder: Path, network: list[str],
                    run_seeds: list[int] = seeds, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        argv = (["bench", "--hosts", str(hosts), *network, "--algorithms", entry, "--to-quality", "--seeds",
                 ",".join(map(str, run_seeds)), *short, *model, *qual, *extra]
                + ([] if target is None else ["--quality-target", repr(target)]))
        return run_or_reuse(folder, argv, run)

    ordered = sorted((e for e in entries if e != "auto"), key=lambda e: e != "allreduce")
    results, target = [], quality_target
    for entry in ordered:
        results.append(quality_run(entry, target, out / "quality" / slug(entry), []))
        if target is None:
            target = dense_target(results[0])
    merged = merge_quality(results, dense=None if quality_target is not None else "allreduce", target=quality_target)
    networks = {}
    for rate in bandwidths:
        argv = ["bench", "--hosts", str(hosts), "--bandwidth", f"{rate:g}", "--algorithms",
                ",".join(timed_entries(entries)), "--steps", str(steps), "--warmup", str(warmup), "--rounds",
                str(rounds), *model, *budget, *_flags(values, TIMING_FLAGS)]
        timing = run_or_reuse(out / f"network-{hosts}x{rate:g}mbit", argv, run)
        if "NOT shaped" in str(timing.get("network", "")):
            raise RuntimeError("the timing runs need an emulated cluster (root: network namespaces and tc); "
                               f"bench ran on loopback instead: {timing.get('network')}")
        auto_job = None
        if "auto" in entries and values.get("auto_probe") == "online":  # auto trained as the job it is
            auto_job = quality_run("auto", merged["target"], out / f"auto-{hosts}x{rate:g}mbit",
                                   ["--bandwidth", f"{rate:g}"], extra=tuple(_flags(values, TIMING_FLAGS)))["quality"]
        networks[f"{rate:g}"] = predict(merged, timing, auto_job)
    validation = []
    if validate_at is not None:
        rates, v_entries, v_seeds = validate_at
        for rate in rates:
            measured = quality_run(",".join(v_entries), merged["target"], out / f"validate-{hosts}x{rate:g}mbit",
                                   ["--bandwidth", f"{rate:g}"], v_seeds,
                                   extra=tuple(_flags(values, TIMING_FLAGS)) if "auto" in v_entries else ())
            validation.append({"bandwidth_mbit": rate, **validate(networks[f"{rate:g}"], measured["quality"])})
    result = {"quality": merged, "networks": networks, "validation": validation, "hosts": hosts}
    (out / "sweep.json").write_text(json.dumps(result, indent=1))
    return result
