"""``gradsync sweep``: predicted time to quality = steps on loopback x iteration time per network, its
validation against a measured run, merging one-entry benches, reuse of finished sub-runs and the
argument checks (no processes: the sub-benches are replaced by recorded results)."""

import json

import pytest

from gradsync.bench.sweep import (TOLERANCE, dense_tail, merge_quality, predict, run_or_reuse, run_sweep,
                                  summary_rows, tail_timing_entry, validate)

SEEDS = [0, 1, 2, 3, 4]


def _quality_bench(name, curves, target=None, seeds=SEEDS):
    """A ``gradsync bench --to-quality`` result of one entry: curves ``[[steps, seconds, quality], ...]``
    per seed (seconds are loopback's and do not matter to the prediction)."""
    from gradsync.bench.quality import summarise_quality

    q = summarise_quality({name: curves}, seeds, True, target, name if target is None else None)
    return {"world_size": 2, "config": {"workload": "fashion-mnist"},
            "quality": {**q, "curves": {name: curves}, "metric": "test accuracy", "budget_steps": 40}}


def _timing(iteration_s, network="2 hosts at 5 Mbit/s"):
    return {"world_size": 2, "network": network, "dense_ccr": 7.0,
            "rows": [{"algorithm": k, "iteration_s": {"median": 0.9 * v, "mean": v}} for k, v in iteration_s.items()]}


# dense ends at 0.90-0.92 (target 0.905) and reaches it at step 40 on seeds 1, 2, 4 only; "fast" reaches it
# at step 20 (seed 3: 30)
DENSE = [[[10, 9.0, 0.5], [20, 9.0, 0.7], [30, 9.0, 0.90], [40, 9.0, f]] for f in (0.90, 0.91, 0.92, 0.90, 0.92)]
FAST = [[[10, 9.0, 0.5], [20, 9.0, 0.6 if s == 3 else 0.95], [30, 9.0, 0.95], [40, 9.0, 0.95]] for s in SEEDS]


def test_prediction_is_steps_to_target_times_iteration_time_and_validates_against_a_measured_run():
    merged = merge_quality([_quality_bench("allreduce", DENSE), _quality_bench("fast", FAST, 0.905)])
    assert merged["target"] == pytest.approx(0.905) and merged["target_from"] == "allreduce"
    pred = predict(merged, _timing({"allreduce": 0.7, "fast": 0.2, "unused": 1.0}))
    d, f = pred["entries"]["allreduce"], pred["entries"]["fast"]
    assert d["seconds_by_seed"] == [None, pytest.approx(28.0), pytest.approx(28.0), None, pytest.approx(28.0)]
    assert f["seconds_by_seed"] == pytest.approx([4.0, 4.0, 4.0, 6.0, 4.0])
    assert f["olympic_mean_s"] == pytest.approx(4.0) and d["olympic_mean_s"] is None  # 2 seeds never reach
    assert f["wins"]["allreduce"] == SEEDS and pred["speedup_vs_dense"]["fast"] is None
    assert pred["iteration_s"] == {"allreduce": 0.7, "fast": 0.2} and pred["dense_ccr"] == 7.0
    # the predicted curves (the sweep's figure): loopback steps and quality, seconds = steps x 0.2 s
    assert pred["curves"]["fast"][3] == [[10, pytest.approx(2.0), 0.5], [20, pytest.approx(4.0), 0.6],
                                         [30, pytest.approx(6.0), 0.95], [40, pytest.approx(8.0), 0.95]]
    # a shaped run measured 4.2 s and 6.5 s on seeds 0 and 3: errors -4.8 % and -7.7 %, within 10 %
    measured = _quality_bench("fast", [FAST[0], FAST[3]], 0.905, seeds=[0, 3])["quality"]
    measured["entries"]["fast"]["seconds_by_seed"] = [4.2, 6.5]
    v = validate(pred, measured)
    assert v["holds"] and v["max_error"] == pytest.approx(1 - 6.0 / 6.5)
    assert [r["seed"] for r in v["rows"]] == [0, 3]
    measured["entries"]["fast"]["seconds_by_seed"] = [4.2, 6.0 / (1 - TOLERANCE) + 0.1]
    assert not validate(pred, measured)["holds"]
    measured["entries"]["fast"]["seconds_by_seed"] = [4.2, None]  # reached in the prediction only
    assert not validate(pred, measured)["holds"]
    measured["target"] = 0.9
    with pytest.raises(ValueError, match="--quality-target"):
        validate(pred, measured)
    with pytest.raises(ValueError, match="missing: fast"):
        predict(merged, _timing({"allreduce": 0.7}))
    # auto: the steps of the entry it chose on that network, its own iteration time
    timing = {**_timing({"allreduce": 0.7, "fast": 0.2, "auto": 0.25}),
              "chosen_from_ccr": {"auto": {"entry": "fast", "reason": "CCR 7.00: ..."}}}
    auto = predict(merged, timing)
    assert auto["auto_choice"] == "fast" and auto["auto_not_swept"] is None
    assert auto["entries"]["auto"]["seconds_by_seed"] == pytest.approx([5.0, 5.0, 5.0, 7.5, 5.0])
    timing["chosen_from_ccr"]["auto"]["entry"] = "other"
    assert "auto" not in predict(merged, timing)["entries"] and predict(merged, timing)["auto_not_swept"] == "other"


def test_an_entry_with_a_dense_tail_is_predicted_with_both_phases_timed():
    tailed = "fast:rank=4:dense_from=25"
    assert dense_tail(tailed) == 25 and dense_tail("fast:rank=4") == 0
    assert tail_timing_entry(tailed) == "fast:rank=4:dense_from=2" and tail_timing_entry("p:dense-from=9") == "p:dense_from=2"
    with pytest.raises(ValueError, match="no dense tail"):
        tail_timing_entry("fast")
    merged = merge_quality([_quality_bench("allreduce", DENSE), _quality_bench(tailed, FAST, 0.905)])
    timing = _timing({"allreduce": 0.7, tailed: 0.2, "fast:rank=4:dense_from=2": 0.5})
    pred = predict(merged, timing)
    # seeds 0, 1, 2, 4 reach the target at step 20, before the tail: 20 x 0.2 s; seed 3 at step 30:
    # 25 compressed steps x 0.2 s + 5 tail steps x 0.5 s
    assert pred["entries"][tailed]["seconds_by_seed"] == pytest.approx([4.0, 4.0, 4.0, 7.5, 4.0])
    assert pred["curves"][tailed][0][-1] == [40, pytest.approx(12.5), 0.95]
    assert pred["tail_iteration_s"] == {tailed: 0.5}
    assert summary_rows(pred)[0]["tail_iteration_ms"] == pytest.approx(500.0)
    with pytest.raises(ValueError, match="missing: fast:rank=4:dense_from=2"):
        predict(merged, _timing({"allreduce": 0.7, tailed: 0.2}))
    # auto choosing the tailed entry: its own iteration time, then the chosen entry's tail
    timing = {**_timing({"allreduce": 0.7, tailed: 0.2, "fast:rank=4:dense_from=2": 0.5, "auto": 0.3}),
              "chosen_from_ccr": {"auto": {"entry": tailed}}}
    assert predict(merged, timing)["entries"]["auto"]["seconds_by_seed"][3] == pytest.approx(25 * 0.3 + 5 * 0.5)


def test_the_predicted_curves_are_plotted(tmp_path):
    pytest.importorskip("matplotlib", reason="needs the bench extra: pip install gradsync[bench]")
    from gradsync.bench.report import plot_quality

    merged = merge_quality([_quality_bench("allreduce", DENSE), _quality_bench("fast", FAST, 0.905)])
    pred = predict(merged, _timing({"allreduce": 0.7, "fast": 0.2}))
    path = plot_quality({**pred, "metric": "test accuracy", "higher_is_better": True}, tmp_path / "p.png",
                        "predicted training time (s)", "2 hosts at 5 Mbit/s")
    assert path == tmp_path / "p.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000  # axes, two entries' lines over five seeds and the target


def test_merge_refuses_mismatched_runs():
    with pytest.raises(ValueError, match="at least one"):
        merge_quality([])
    other = _quality_bench("fast", FAST, 0.905)
    other["world_size"] = 3
    with pytest.raises(ValueError, match="world size"):
        merge_quality([_quality_bench("allreduce", DENSE), other])
    with pytest.raises(ValueError, match="more than one"):
        merge_quality([_quality_bench("allreduce", DENSE), _quality_bench("allreduce", DENSE)])


def _recording_bench(calls, quality, timing):
    """Stands in for ``gradsync bench``: records each argv in ``calls`` and writes the result a real run would,
    ``quality(entries, target, seeds)`` for a ``--to-quality`` run, else ``timing(entries)``."""
    def bench(argv):
        from pathlib import Path

        calls.append(argv)
        entries = argv[argv.index("--algorithms") + 1]
        if "--to-quality" in argv:
            target = float(argv[argv.index("--quality-target") + 1]) if "--quality-target" in argv else None
            result = quality(entries, target, [int(x) for x in argv[argv.index("--seeds") + 1].split(",")])
        else:
            result = timing(entries)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result))
        return 0
    return bench


def test_sweep_runs_dense_first_passes_its_target_on_and_reuses_finished_sub_runs(tmp_path):
    calls = []

    def quality(entries, target, seeds):
        curves = [c for s, c in zip(SEEDS, DENSE if entries == "allreduce" else FAST) if s in seeds]
        return _quality_bench(entries, curves, target, seeds)

    fake_bench = _recording_bench(calls, quality, lambda entries: _timing({e: 0.1 for e in entries.split(",")}))

    values = {"epochs": 2, "eval_every": 26}
    run = lambda: run_sweep(["fast", "auto", "allreduce"], SEEDS, 2, [5.0, 40.0], tmp_path, values, fake_bench)  # noqa: E731
    result = run()
    quality_calls = [c for c in calls if "--to-quality" in c]
    assert [c[c.index("--algorithms") + 1] for c in quality_calls] == ["allreduce", "fast"]  # auto: timed only
    assert "--quality-target" not in quality_calls[0]
    assert float(quality_calls[1][quality_calls[1].index("--quality-target") + 1]) == pytest.approx(0.905)
    assert all(c[c.index("--epochs") + 1] == "2" and "--bandwidth" not in c for c in quality_calls)
    assert [c[c.index("--bandwidth") + 1] for c in calls if "--to-quality" not in c] == ["5", "40"]
    assert set(result["networks"]) == {"5", "40"} and (tmp_path / "sweep.json").exists()
    n = len(calls)
    run()
    assert len(calls) == n, "a rerun with the same arguments reuses every finished sub-run"
    # validation: a full shaped to-quality run per rate with the sweep's target, compared per seed
    v = run_sweep(["fast", "allreduce"], SEEDS, 2, [5.0, 40.0], tmp_path, values, fake_bench,
                  validate_at=([5.0], ["fast"], [0, 3]))["validation"]
    shaped = calls[-1]
    assert shaped[shaped.index("--bandwidth") + 1] == "5" and shaped[shaped.index("--seeds") + 1] == "0,3"
    assert float(shaped[shaped.index("--quality-target") + 1]) == pytest.approx(0.905)
    # the stand-in's "measured" seconds (9 s a point) are not steps x 0.1 s: the prediction does not hold
    assert [r["seed"] for r in v[0]["rows"]] == [0, 3] and v[0]["bandwidth_mbit"] == 5.0 and not v[0]["holds"]
    # an entry with a dense tail: its tail is timed on every network, and the budget reaches the timing runs
    calls.clear()
    run_sweep(["fast:dense_from=25", "allreduce"], SEEDS, 2, [5.0], tmp_path / "tail", values, fake_bench)
    timed = [c for c in calls if "--to-quality" not in c]
    assert timed[0][timed[0].index("--algorithms") + 1] == "fast:dense_from=25,allreduce,fast:dense_from=2"
    assert timed[0][timed[0].index("--epochs") + 1] == "2" and "--eval-every" not in timed[0]
    with pytest.raises(ValueError, match="allreduce"):
        run_sweep(["fast"], SEEDS, 2, [5.0], tmp_path, {}, fake_bench)
    with pytest.raises(ValueError, match="hosts"):
        run_sweep(["allreduce"], SEEDS, 1, [5.0], tmp_path, {}, fake_bench)
    with pytest.raises(ValueError, match="validation rates"):
        run_sweep(["allreduce"], SEEDS, 2, [5.0], tmp_path, {}, fake_bench, validate_at=([5.0, 10.0], ["allreduce"], [0]))


def test_online_auto_is_trained_as_a_job_on_every_network_and_its_measured_seconds_stand(tmp_path):
    """``--auto-probe online``: auto's time is not its choice's steps x its iteration but a shaped to-quality run
    of ``auto`` alone per network, each seed a job that decided on its own steps (its seconds as measured)."""
    calls = []
    # the jobs' own curves: measured seconds (start-up included), a choice per seed
    job = [[[10, 3.0, 0.5], [20, 6.5, 0.95 if s != 2 else 0.6], [30, 9.0, 0.95], [40, 12.0, 0.95]] for s in SEEDS]

    def quality(entries, target, seeds):
        result = _quality_bench(entries, {"allreduce": DENSE, "fast": FAST, "auto": job}[entries], target)
        if entries == "auto":
            result["quality"]["auto_decisions"] = [{"auto_choice": "fast" if s != 2 else "fp16"} for s in SEEDS]
        return result

    fake_bench = _recording_bench(calls, quality, lambda entries: {
        **_timing({e: 0.2 for e in entries.split(",")}), "chosen_from_ccr": {"auto": {"entry": "fast", "probe_seconds": 1.0}}})

    values = {"epochs": 2, "eval_every": 26, "auto_probe": "online"}
    result = run_sweep(["fast", "auto", "allreduce"], SEEDS, 2, [5.0, 40.0], tmp_path, values, fake_bench)
    jobs = [c for c in calls if "--to-quality" in c and c[c.index("--algorithms") + 1] == "auto"]
    assert [c[c.index("--bandwidth") + 1] for c in jobs] == ["5", "40"]
    assert all(c[c.index("--auto-probe") + 1] == "online" and "--quality-target" in c for c in jobs)
    auto = result["networks"]["5"]["entries"]["auto"]
    assert auto["seconds_by_seed"] == pytest.approx([6.5, 6.5, 9.0, 6.5, 6.5]), "the jobs' own seconds"
    assert result["networks"]["5"]["auto_choices"] == ["fast", "fast", "fp16", "fast", "fast"]
    assert result["networks"]["5"]["auto_choice"] == "fast"
    from gradsync.bench.sweep import auto_label

    assert auto_label(result["networks"]["5"]) == "auto (jobs chose fast on 4 of 5 seeds, fp16 on 1)"
    fast = result["networks"]["5"]["entries"]["fast"]["seconds_by_seed"]
    assert fast == pytest.approx([4.0, 4.0, 4.0, 6.0, 4.0]), "fixed entries: steps x iteration"
    n = len(calls)
    run_sweep(["fast", "auto", "allreduce"], SEEDS, 2, [5.0, 40.0], tmp_path, values, fake_bench)
    assert len(calls) == n, "the jobs are reused like any sub-run"
    # a validation of auto measures as its jobs did (online); one of a fixed entry has nothing to probe
    for entry in ("auto", "fast"):
        run_sweep(["fast", "auto", "allreduce"], SEEDS, 2, [5.0, 40.0], tmp_path / entry, values, fake_bench,
                  validate_at=([5.0], [entry], [0, 3]))
        shaped = calls[-1]
        assert shaped[shaped.index("--algorithms") + 1] == entry and shaped[shaped.index("--seeds") + 1] == "0,3"
        assert ("--auto-probe" in shaped) == (entry == "auto")


def test_a_timing_run_on_loopback_is_refused(tmp_path):
    def loopback(argv):
        folder = argv[argv.index("--out") + 1]
        from pathlib import Path

        Path(folder).mkdir(parents=True, exist_ok=True)
        result = (_quality_bench("allreduce", DENSE) if "--to-quality" in argv
                  else _timing({"allreduce": 0.1}, network="loopback, NOT shaped (no --bandwidth)"))
        (Path(folder) / "bench.json").write_text(json.dumps(result))
        return 0

    with pytest.raises(RuntimeError, match="emulated cluster"):
        run_sweep(["allreduce"], SEEDS, 2, [5.0], tmp_path, {}, loopback)


def test_run_or_reuse_raises_when_the_bench_fails(tmp_path):
    with pytest.raises(RuntimeError, match="exit status 2"):
        run_or_reuse(tmp_path / "a", ["bench", "--algorithms", "allreduce"], lambda argv: 2)


def test_cli_refuses_before_any_run_where_no_cluster_can_be_built(tmp_path, monkeypatch, capsys):
    import gradsync.bench.sweep as sweep_module
    import gradsync.cluster.commands as commands
    from gradsync.cli import main

    monkeypatch.setattr(commands, "why_unshaped", lambda: "not root")
    ran = []
    monkeypatch.setattr(sweep_module, "run_sweep", lambda *a, **k: ran.append(a))
    rc = main(["sweep", "--algorithms", "allreduce,fp16", "--bandwidths", "5", "--out", str(tmp_path)])
    assert rc == 1 and not ran and not any(tmp_path.iterdir())
    assert "cannot build one: not root" in capsys.readouterr().err


def test_a_sweep_writes_its_accuracy_cost_rows_with_provenance(tmp_path):
    import argparse

    from gradsync.bench.accuracy_costs import SCHEMA, merge_rows
    from gradsync.cli.sweep import _write_cost_rows

    # "slow" reaches the target at step 40 on seeds 0-2 and misses it on seeds 3 and 4
    slow = [[[10, 9.0, 0.5], [40, 9.0, 0.95 if s < 3 else 0.8]] for s in SEEDS]
    merged = merge_quality([_quality_bench("allreduce", DENSE), _quality_bench("fast", FAST, 0.905),
                            _quality_bench("slow", slow, 0.905)])
    args = argparse.Namespace(model=None, out=str(tmp_path), argv=["sweep", "--algorithms", "allreduce,fast,slow"])
    data = json.loads(_write_cost_rows(merged, args).read_text())
    assert data["schema"] == SCHEMA
    fast, slow_row = data["rows"]
    assert (fast["entry"], fast["model"], fast["world_size"], fast["optimizer"]) == ("fast", "fashion-mnist:resnet8", 2, "sgd")
    # olympic mean over 5 seeds (20, 20, 20, 30, 20 -> 20); dense reached on 3 of 5 seeds: never, so the budget
    assert (fast["steps"], fast["per_seed_steps"], fast["not_reached"]) == (20, [20, 20, 20, 30, 20], False)
    assert fast["dense_steps"] == 40 and fast["budget_steps"] == 40
    assert slow_row["per_seed_steps"] == [40, 40, 40, None, None] and slow_row["not_reached"]
    assert fast["source"] == "gradsync sweep --algorithms allreduce,fast,slow" and fast["commit"] and fast["machine"]
    # a row of the same model, world size, entry and command replaces the old one; others stay
    old = [dict(fast, steps=99), dict(fast, source="another grid")]
    assert merge_rows(old, [fast]) == [old[1], fast]
