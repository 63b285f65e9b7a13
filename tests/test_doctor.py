"""gradsync doctor: the advice rule (gradsync.profiler.advise) on synthetic profiles, the table of
measured accuracy costs, the module:function model spec, and one CLI run on fashion-mnist."""

from __future__ import annotations

import json

import pytest

from gradsync.bench.config import parse_entry
from gradsync.algorithms import split_dense_tail
from gradsync.cli import main
from gradsync.profiler.accuracy_costs import MEASURED_COSTS, AccuracyCost
from gradsync.profiler.advise import LOW_CCR, MIN_GAIN, advise, candidates, train_command
from gradsync.profiler.profile import model_for_profile
from gradsync.sim import synthetic_profile

#: 8 equal buckets of 20k fp32 elements (640 KB), 10 ms forward, 30 ms backward: CCR 0.17 at 1 Gbit/s
#: and 2 ranks, 8.5 at 20 Mbit/s.
PROFILE = synthetic_profile([20_000] * 8, 0.010, 0.030, 0.002)
ENTRIES = [c[0] for c in candidates()]


def _cost(entry: str, steps: int) -> AccuracyCost:
    return AccuracyCost(entry, steps, 200, 2, 1, "synthetic", "80 %", "test")


def test_low_ccr_keeps_ddp():
    a = advise(PROFILE, 2, 1000)
    assert a.ccr < LOW_CCR and a.choice.entry == "allreduce"
    assert a.reason.startswith(f"CCR {a.ccr:.2f} < {LOW_CCR}") and "plain DDP" in a.reason
    assert a.dense_allreduce_s == pytest.approx(a.ccr * PROFILE.backward_s)


def test_high_ccr_picks_a_measured_compressed_setting():
    a = advise(PROFILE, 2, 20)
    assert a.ccr > 5 and a.choice.entry != "allreduce" and a.choice.measured
    ddp = next(r for r in a.predictions if r.entry == "allreduce")
    assert ddp.speedup == 1.0 and ddp.time_to_quality_s / a.choice.time_to_quality_s >= MIN_GAIN
    # measured (or exact, or cast) settings come first, by iteration time x (1 + extra steps); then the rest
    known = [r for r in a.predictions if r.measured]
    assert [r.measured for r in a.predictions] == [True] * len(known) + [False] * (len(a.predictions) - len(known))
    assert [r.time_to_quality_s for r in known] == sorted(r.time_to_quality_s for r in known)
    for r in known:
        assert r.time_to_quality_s == pytest.approx(r.iteration_s * (1 + r.extra_steps))
    assert {r.entry for r in a.predictions} == set(ENTRIES)
    assert next(r for r in a.predictions if r.entry == "covap:ratio=6:cast=fp16").cost == "not measured"
    assert next(r for r in a.predictions if r.entry == "topk:density=0.01").cost.startswith("missed the target")
    json.dumps(a.to_dict())


def test_a_measured_cost_changes_the_pick():
    # no measurements: only DDP's arithmetic (allreduce, DeAR) and the casts have a known cost -> fp16
    # (bf16 ties on time and comes later), although COVAP K=3 is predicted faster per iteration
    bare = advise(PROFILE, 2, 20, costs=())
    k3 = next(r for r in bare.predictions if r.entry == "covap:ratio=3:cast=fp16")
    assert bare.choice.entry == "fp16" and k3.iteration_s < bare.choice.iteration_s and not k3.measured
    fastest = min((r for r in bare.predictions if not r.measured), key=lambda r: r.iteration_s)
    assert f"{fastest.label} is predicted" in bare.reason  # the fastest unmeasured setting is named
    # K=3 measured at no extra steps: picked; at 4x the steps: fp16 again
    k3_free = advise(PROFILE, 2, 20, costs=(_cost("covap:ratio=3:cast=fp16", 200),))
    assert k3_free.choice.entry == "covap:ratio=3:cast=fp16"
    assert advise(PROFILE, 2, 20, costs=(_cost("covap:ratio=3:cast=fp16", 800),)).choice.entry == "fp16"


def test_measurement_closest_in_world_size():
    costs = (AccuracyCost("covap:ratio=2:cast=fp16", 225, 225, 2, 3, "synthetic", "80 %", "test"),
             AccuracyCost("covap:ratio=2:cast=fp16", 200, 175, 4, 3, "synthetic", "80 %", "test"))
    at2 = {r.entry: r for r in advise(PROFILE, 2, 20, costs=costs).predictions}
    at8 = {r.entry: r for r in advise(PROFILE, 8, 20, costs=costs).predictions}
    assert at2["covap:ratio=2:cast=fp16"].extra_steps == 0.0  # 225 vs 225 steps, 2 hosts
    assert at8["covap:ratio=2:cast=fp16"].extra_steps == pytest.approx(200 / 175 - 1)  # 4 hosts


def test_cost_table_and_candidates_are_valid_settings():
    for entry in ENTRIES:
        name, _ = parse_entry(entry)
        assert train_command(entry).startswith(f"gradsync train --algorithm {name}")
    assert train_command("covap:ratio=2:cast=fp16", 0.05) == \
        "gradsync train --algorithm covap --ratio 2 --cast fp16 --bucket-cap-mb 0.05"
    for row in MEASURED_COSTS:  # every published row names a candidate (a tail: with its budget) and its source
        assert "results" in row.source and row.steps > 0 and row.dense_steps > 0
        assert row.entry in ENTRIES or row.budget_steps > 0 and row.entry.rsplit(":dense_from=", 1)[0] in ENTRIES


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        advise(PROFILE, 1, 100)
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        advise(PROFILE, 2, 0)


@pytest.mark.parametrize("argv, flag", [(["--bandwidth", "0", "--world-size", "4"], "--bandwidth"),
                                        (["--bandwidth", "100", "--world-size", "1"], "--world-size"),
                                        (["--bandwidth", "100", "--world-size", "2", "--budget-steps", "0"],
                                         "--budget-steps")])
def test_cli_refuses_bad_network(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_module_function_model(tmp_path, monkeypatch):
    (tmp_path / "doctor_user_model.py").write_text(
        "import torch\n"
        "def build():\n    return torch.nn.Linear(5, 3)\n"
        "def make_batch(batch_size):\n    return torch.randn(batch_size, 5), torch.randint(0, 3, (batch_size,))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
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
                 "--bandwidth", "10", "--world-size", "2", "--compute-scale", "0.5", "--budget-steps", "468",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Recommendation:" in text and "Why: CCR" in text and "gradsync train --algorithm" in text
    d = json.loads(out.read_text())
    assert {"profile", "ccr", "dense_allreduce_s", "predictions", "choice", "reason", "notes", "command",
            "bucket_cap_mb"} <= set(d)
    assert d["compute_scale"] == 0.5 and d["backward_s"] == d["profile"]["backward_s"] > 0
    # every candidate, plus the measured dense tails scaled to the budget (700 of 936 and 467 of 624 -> 350 of 468)
    tails = {f"{split_dense_tail(r.entry)[0]}:dense_from={round(split_dense_tail(r.entry)[1] * 468 / r.budget_steps)}"
             for r in MEASURED_COSTS if r.optimizer == "sgd" and split_dense_tail(r.entry)[1]}
    assert "powersgd:matrix_approximation_rank=4:dense_from=350" in tails
    assert d["ccr"] > 0 and {p["entry"] for p in d["predictions"]} == {*ENTRIES, *tails}
    assert d["choice"]["entry"] in {*ENTRIES, *tails}
    assert len(d["profile"]["buckets"]) >= 4  # --bucket-cap-mb auto: enough buckets to overlap
    assert d["command"] == train_command(d["choice"]["entry"], d["bucket_cap_mb"])
