"""gradsync doctor: the advice rule (gradsync.profiler.advise) on synthetic profiles and measured
errors, the grids' rows, the module:function model spec, and one CLI run on fashion-mnist."""

from __future__ import annotations

import json

import pytest
import torch

from gradsync.bench.config import parse_entry
from gradsync.algorithms import split_dense_tail
from gradsync.cli import main
from gradsync.profiler.advise import (LOW_CCR, MIN_GAIN, PERIODIC_COST, advise, candidates, lossy,
                                      periodic_predictions, train_command)
from gradsync.profiler.profile import model_for_profile
from gradsync.sim import synthetic_profile

#: 8 equal buckets of 20k fp32 elements (640 KB), 10 ms forward, 30 ms backward: CCR 0.17 at 1 Gbit/s
#: and 2 ranks, 8.5 at 20 Mbit/s.
PROFILE = synthetic_profile([20_000] * 8, 0.010, 0.030, 0.002)
ENTRIES = [c[0] for c in candidates()]


def test_low_ccr_keeps_ddp():
    a = advise(PROFILE, 2, 1000)
    assert a.ccr < LOW_CCR and a.choice.entry == "allreduce"
    assert a.reason.startswith(f"CCR {a.ccr:.2f} < {LOW_CCR}") and "plain DDP" in a.reason
    assert a.dense_allreduce_s == pytest.approx(a.ccr * PROFILE.backward_s)


#: errors as the probe measures them (ResNet-8-like): PowerSGD's ranks and COVAP's K
ERRORS = {"fp16": 0.0003, "bf16": 0.002, **{f"powersgd:matrix_approximation_rank={r}": e for r, e in
                                            ((1, 0.8), (2, 0.7), (4, 0.5), (8, 0.33), (16, 0.08))},
          **{f"powersgd-overlap:matrix_approximation_rank={r}": e for r, e in ((4, 0.5), (8, 0.33))},
          "covap:ratio=2:cast=fp16": 0.67, "topk:density=0.01": 0.69}
#: the ResNet-8's gradient noise (one rank's gradient against the average, benchmarks/data/probe_errors.json)
NOISE = 0.64


def test_high_ccr_picks_a_measured_compressed_setting():
    a = advise(PROFILE, 2, 20, errors=ERRORS, noise=NOISE)
    assert a.ccr > 5 and a.choice.entry != "allreduce" and a.choice.measured
    ddp = next(r for r in a.predictions if r.entry == "allreduce")
    assert ddp.speedup == 1.0 and ddp.time_to_quality_s / a.choice.time_to_quality_s >= MIN_GAIN
    # measured (or exact) settings come first, by iteration time x (1 + extra steps); then the rest
    known = [r for r in a.predictions if r.measured]
    assert [r.measured for r in a.predictions] == [True] * len(known) + [False] * (len(a.predictions) - len(known))
    assert [r.time_to_quality_s for r in known] == sorted(r.time_to_quality_s for r in known)
    for r in known:
        assert r.time_to_quality_s == pytest.approx(r.iteration_s * (1 + r.extra_steps))
    assert {r.entry for r in a.predictions} == set(ENTRIES)
    assert next(r for r in a.predictions if r.entry == "covap:ratio=6:cast=fp16").cost == "not measured"
    assert "predicted to miss" in next(r for r in a.predictions if r.entry == "topk:density=0.01").cost
    json.dumps(a.to_dict())


def test_a_measured_error_changes_the_pick():
    # nothing measured: only DDP's arithmetic (allreduce, DeAR) has a known cost -> DeAR, too little faster
    bare = advise(PROFILE, 2, 20)
    assert bare.choice.entry == "allreduce" and all(not r.measured for r in bare.predictions if lossy(r.entry))
    fastest = min((r for r in bare.predictions if not r.measured), key=lambda r: r.iteration_s)
    assert f"{fastest.label} is predicted" in bare.reason  # the fastest unmeasured setting is named
    # K=3 measured with a small error: picked; with a large one: predicted to miss, fp16 again
    k3_good = advise(PROFILE, 2, 20, errors={"fp16": 0.0003, "covap:ratio=3:cast=fp16": 0.05}, noise=NOISE)
    assert k3_good.choice.entry == "covap:ratio=3:cast=fp16"
    assert advise(PROFILE, 2, 20, errors={"fp16": 0.0003, "covap:ratio=3:cast=fp16": 0.9}, noise=NOISE).choice.entry == "fp16"


def test_a_measured_compression_time_is_added_to_the_simulated_iteration_not_to_a_timed_one():
    """advise(overheads=): a hook's own computation per step (probe.compression_seconds) is charged to its
    simulated iteration, serially; an iteration timed on the network already holds it. 100 ms of r=16
    compression on a 40 ms step turns the pick from PowerSGD r=16 to another setting."""
    r16 = "powersgd:matrix_approximation_rank=16"
    bare = advise(PROFILE, 2, 20, errors=ERRORS, noise=NOISE)
    charged = advise(PROFILE, 2, 20, errors=ERRORS, noise=NOISE, overheads={r16: 0.100})
    timed = advise(PROFILE, 2, 20, errors=ERRORS, noise=NOISE, overheads={r16: 0.100}, iterations={r16: 0.050})
    at = {a: next(r.iteration_s for r in a.predictions if r.entry == r16) for a in (bare, charged, timed)}
    assert at[charged] == pytest.approx(at[bare] + 0.100) and at[timed] == 0.050
    for a in (bare, charged):  # the others unchanged
        assert [r.iteration_s for r in a.predictions if r.entry == "fp16"] == [
            r.iteration_s for r in bare.predictions if r.entry == "fp16"]
    assert bare.choice.entry == r16 and charged.choice.entry != r16


def test_candidates_and_the_grids_rows_are_valid_settings():
    import pathlib

    for entry in ENTRIES:
        name, _ = parse_entry(entry)
        assert train_command(entry).startswith(f"gradsync train --algorithm {name}")
    assert train_command("covap:ratio=2:cast=fp16", 0.05) == \
        "gradsync train --algorithm covap --ratio 2 --cast fp16 --bucket-cap-mb 0.05"
    rows = json.loads((pathlib.Path(__file__).parents[1] / "benchmarks" / "data" / "accuracy_costs.json")
                      .read_text())["rows"]
    for row in rows:  # every published row names a candidate (a tail: its compressed phase) and its source
        assert ("results" in row["source"] or row["source"].startswith(("gradsync sweep ", "gradsync bench "))) and row["steps"] > 0 \
            and row["dense_steps"] > 0
        assert split_dense_tail(row["entry"])[0] in ENTRIES


def test_periodic_settings_are_predicted_but_never_ranked():
    from gradsync.algorithms import make_options
    from gradsync.sim import Network, allreduce_time

    # auto and advise rank candidates() only: no local-sgd or diloco among them, whatever was measured
    for a in (advise(PROFILE, 2, 20), advise(PROFILE, 2, 20, errors=ERRORS, noise=NOISE)):
        assert not any(r.entry.startswith(("local-sgd", "diloco")) for r in a.predictions)
    rows = periodic_predictions(PROFILE, 2, 20)
    assert [r.entry for r in rows] == ["local-sgd:period=4", "local-sgd:period=16", "local-sgd:period=64",
                                       "diloco:period=4", "diloco:period=16", "diloco:period=64",
                                       "diloco:period=16:fragments=4", "diloco:period=16:fragments=4:overlap=3"]
    one_sync = allreduce_time(PROFILE.total_numel * 4, 2, Network.from_mbit(20))
    ddp = advise(PROFILE, 2, 20).predictions
    ddp_s = next(r.iteration_s for r in ddp if r.entry == "allreduce")
    for r in rows:
        options = make_options(*parse_entry(r.entry))  # a valid entry (fragments <= period, overlap in range)
        fragments, overlap = getattr(options, "fragments", 1), getattr(options, "overlap", 0)
        # each of the F syncs of a period: what the next `overlap` iterations' compute cannot hide
        per_sync = max(0.0, one_sync / fragments - overlap * PROFILE.compute_s)
        assert r.iteration_s == pytest.approx(PROFILE.compute_s + fragments * per_sync / options.period,
                                              rel=0.01, abs=1e-6), r.entry
        assert r.speedup == pytest.approx(ddp_s / r.iteration_s)
        assert not r.measured and r.cost == PERIODIC_COST and r.time_to_quality_s is None
        assert train_command(r.entry).startswith(f"gradsync train --algorithm {parse_entry(r.entry)[0]} --period")


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        advise(PROFILE, 1, 100)
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        advise(PROFILE, 2, 0)


@pytest.mark.parametrize("argv, flag", [(["--bandwidth", "0", "--world-size", "4"], "--bandwidth"),
                                        (["--bandwidth", "100", "--world-size", "1"], "--world-size"),
                                        (["--bandwidth", "100", "--world-size", "2", "--quality-ranks", "1"],
                                         "--quality-ranks")])
def test_cli_refuses_bad_network(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


@pytest.fixture
def user_model(tmp_path, monkeypatch):
    """A ``module:function`` model spec on the import path: ``doctor_user_model:build``."""
    (tmp_path / "doctor_user_model.py").write_text(
        "import torch\n"
        "def build():\n    return torch.nn.Linear(5, 3)\n"
        "def make_batch(batch_size):\n    return torch.randn(batch_size, 5), torch.randint(0, 3, (batch_size,))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "doctor_user_model:build"


def test_module_function_model(user_model):
    model, make_batch, loss_fn = model_for_profile("doctor_user_model:build", 4)
    x, y = make_batch()
    assert x.shape == (4, 5) and loss_fn(model(x), y).ndim == 0
    with pytest.raises(ValueError, match="make_batch"):
        model_for_profile("doctor_user_model:nope", 4)
    with pytest.raises(ValueError, match="cannot import"):
        model_for_profile("no_such_module_here:build", 4)


def test_cli_fashion_mnist(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--model", "fashion-mnist", "--batch-size", "8", "--iterations", "1",
                 "--bandwidth", "10", "--world-size", "2", "--compute-scale", "0.5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Recommendation:" in text and "Why: CCR" in text and "gradsync train --algorithm" in text
    assert "Measuring this job took" in text
    d = json.loads(out.read_text())
    assert d["optimizer_family"] == "sgd"  # the workload's recipe optimizer
    assert {"profile", "ccr", "dense_allreduce_s", "predictions", "choice", "reason", "notes", "command",
            "bucket_cap_mb", "errors"} <= set(d) and d["quality_ranks"] == 2
    assert d["compute_scale"] == 0.5 and d["backward_s"] == d["profile"]["backward_s"] > 0
    assert d["ccr"] > 0 and {p["entry"] for p in d["predictions"]} == set(ENTRIES)
    assert len(d["periodic"]) == 8 and "DiLoCo" in text and all(p["cost"] == PERIODIC_COST
                                                                    for p in d["periodic"])
    # every lossy hook the simulator gives a chance was measured on this model: errors in [0, 2), the
    # casts near 0, PowerSGD's error falling with its rank
    assert d["errors"] and all(0 <= e < 2 for e in d["errors"].values())
    if "fp16" in d["errors"]:
        assert d["errors"]["fp16"] < 0.01
    ranks = [d["errors"][f"powersgd-overlap:matrix_approximation_rank={r}"] for r in (1, 4, 16)
             if f"powersgd-overlap:matrix_approximation_rank={r}" in d["errors"]]
    assert ranks == sorted(ranks, reverse=True)
    assert d["choice"]["entry"] in ENTRIES
    assert len(d["profile"]["buckets"]) >= 4  # --bucket-cap-mb auto: enough buckets to overlap
    assert d["command"] == train_command(d["choice"]["entry"], d["bucket_cap_mb"])


def test_cli_user_model_optimizer_family(user_model, tmp_path, capsys):
    # a model outside the workloads: its optimizer is not known unless given, and the strictest family's limit applies.
    # 1 kbit/s: its 72-byte all-reduce (0.58 s) outweighs any compression's computation, so the metered settings
    # (COVAP, top-k) are worth measuring on any load (at 1 Mbit/s top-k's simulated 1.49 ms against DDP's 1.59 ms;
    # on 4 busy pytest workers nothing was metered and the note below was missing)
    out = tmp_path / "doctor.json"
    argv = ["doctor", "--model", user_model, "--batch-size", "8", "--iterations", "1", "--bandwidth", "0.001",
            "--world-size", "2", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["optimizer_family"] is None
    assert "the strictest: the optimizer is not known" in " ".join(capsys.readouterr().out.split())
    assert main(argv + ["--optimizer", "SGD"]) == 0
    assert json.loads(out.read_text())["optimizer_family"] == "sgd"
    assert "(optimizer family sgd)" in " ".join(capsys.readouterr().out.split())


def test_loopback_ranks_measure_on_their_own_batches(user_model):
    # doctor's loopback ranks each draw their own batches (a quality measured on identical gradients
    # would hide what averaging several ranks' compressed gradients costs); a workload uses its training
    # batches as auto sees them on a job
    from gradsync.profiler.probe import QUALITY_STEPS, _job_on_rank

    for spec in (user_model, "fashion-mnist"):
        jobs = [_job_on_rank(spec, 8, rank, 2, None, seed=3) for rank in (0, 1)]
        (m0, b0, _, _), (m1, b1, _, _) = jobs
        assert len(b0) == len(b1) == QUALITY_STEPS and b0[0][0].shape[0] == 8
        assert not torch.equal(b0[0][0], b1[0][0]), spec
        assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters())), spec  # one model
