"""benchmarks/outcome_noise.py: twins, the best in-sample cut and the crossings, on hand-made points (the script's
printout on the committed data is reported in docs/results.md)."""

import importlib.util
import json
import sys
from pathlib import Path

from gradsync.profiler.quality_model import QualityPoint

_bench = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    """benchmarks/NAME.py as a module (its own imports of fit_quality_model resolve beside it)."""
    sys.path.insert(0, str(_bench))
    try:
        spec = importlib.util.spec_from_file_location(name, _bench / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_bench))
    return module


outcome_noise = _script("outcome_noise")

T, O = "powersgd:matrix_approximation_rank=", "powersgd-overlap:matrix_approximation_rank="


def point(workload: str, entry: str, ratio: float, missed: int) -> QualityPoint:
    # error_to_noise at 2 ranks is error / noise: noise 1 makes the error the ratio
    return QualityPoint(ratio, 1.0, 2, 0.0, workload, "sgd", entry, (True,) * missed + (False,) * (5 - missed))


def test_twins_pair_torch_and_overlapped_at_one_rank_and_workload():
    pts = [point("a x2", T + "4", 1.0, 2), point("a x2", O + "4", 1.0, 0), point("a x2", O + "8", 0.5, 0),
           point("b x2", O + "4", 1.0, 0), point("a x2", T + "4:dense_from=700", 1.0, 3)]
    pairs = outcome_noise.twins(pts)
    assert [(a.entry, b.entry, a.workload) for a, b in pairs] == [(T + "4", O + "4", "a x2")]
    assert pairs[0][0].missed and not pairs[0][1].missed  # 2 of 5 missed fails, 0 of 5 reaches


def test_best_cut_and_crossings():
    pts = [point("a x2", "fp16", 0.0, 0), point("a x2", O + "8", 0.4, 0), point("a x2", O + "4", 0.9, 3),
           point("b x2", O + "8", 0.6, 2), point("b x2", O + "4", 1.2, 0)]
    # accept at or below 0.4: wrong only on b's r=4 (reached at 1.2); no cut gets b's two rows right together
    assert outcome_noise.best_cut([(q.ratio, q.missed) for q in pts]) == (0.4, 1)
    crossed = outcome_noise.crossings(pts)
    # b reached at 1.2 above a's miss at 0.9; a's reaching rows (0, 0.4) lie below b's miss at 0.6
    assert [(g.workload, g.entry, b.workload, b.entry) for g, b in crossed] == [("b x2", O + "4", "a x2", O + "4")]
    pts.append(point("a x2", O + "2", 0.7, 1))  # now a reached at 0.7 above b's miss at 0.6 too
    assert [(g.entry, b.workload) for g, b in outcome_noise.crossings(pts)] == [(O + "4", "a x2"), (O + "2", "b x2")]


def test_quality_signals_jobs_cover_every_plain_powersgd_row():
    """benchmarks/quality_signals.py measures each (model, world size, rank) of a PowerSGD row without a dense tail."""
    qs = _script("quality_signals")
    assert qs.powersgd_rank(T + "4") == 4 and qs.powersgd_rank(O + "16") == 16
    assert qs.powersgd_rank(T + "4:dense_from=700") is None and qs.powersgd_rank("fp16") is None
    jobs = qs.jobs_from_data()
    assert jobs[("fashion-mnist:vgg", 2)] == {2, 4, 8, 16}
    assert jobs[("fashion-mnist:squeezenet", 2)] == {2, 4, 8}
    measured = {(j["model"], j["world_size"], j["rank"])
                for j in json.load(open(_bench / "data" / "quality_signals.json"))["jobs"]}
    assert measured == {(m, w, r) for (m, w), ranks in jobs.items() for r in ranks}
