"""benchmarks/crossover.py: the crossover-rate interpolation (the bench runs themselves need root and
minutes; the script was run by hand at a tiny size)."""

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "crossover", Path(__file__).resolve().parents[1] / "benchmarks" / "crossover.py")
crossover = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crossover)


def test_interpolates_in_log_rate():
    c = crossover.crossover_rate([10, 100], [1.5, 0.5])
    assert c["kind"] == "interpolated" and not c["non_monotone"]
    assert c["rate"] == pytest.approx(math.sqrt(10 * 100))  # halfway in log(rate)
    c = crossover.crossover_rate([1000, 10, 100, 50], [0.8, 2.0, 0.9, 1.2])  # unsorted input
    t = 0.2 / (0.2 + 0.1)
    assert c["rate"] == pytest.approx(math.exp(math.log(50) + t * math.log(2)))
    assert crossover.crossover_rate([10, 100], [1.0 + 1e-9, 1.0])["rate"] == pytest.approx(100)


def test_edges_and_noise():
    assert crossover.crossover_rate([10, 100], [1.2, 1.1]) == {"rate": 100, "kind": "above_all",
                                                               "non_monotone": False}
    assert crossover.crossover_rate([10, 100], [0.9, 1.0]) == {"rate": 10, "kind": "below_all",
                                                               "non_monotone": False}
    assert crossover.crossover_rate([10, 100], [0.9, 1.1])["kind"] == "rising"
    c = crossover.crossover_rate([10, 25, 50, 100], [1.3, 0.9, 1.1, 0.8])  # two crossings: take the fastest
    assert c["non_monotone"] and 50 < c["rate"] < 100
    with pytest.raises(ValueError, match="rates"):
        crossover.crossover_rate([10], [1.0, 2.0])
    with pytest.raises(ValueError, match="rates"):
        crossover.crossover_rate([0, 10], [1.0, 2.0])
