"""COVAP ``ratio="auto"`` outside ``gradsync train``/``bench``: the hook calibrates K itself from its
own first iterations (real timings, never injected), every rank agreeing, and keeps adapting.

* On 127.0.0.1 (2 Gloo ranks) the CCR is whatever the machine gives, so only the structure is
  checked: the state calibrates at ``calibration_iter`` on every rank with the same K, and an
  explicit :meth:`CovapState.calibrate` (what train and bench do) is not overridden.
* On the emulated cluster (2 hosts in network namespaces, needs root and iproute2; skipped with
  the reason otherwise): 1.2 MB of gradients at 20 Mbit/s, and issue 18's case, 6.3 MB at
  100 Mbit/s with ``cast="fp16"``, take 0.25-0.5 s per dense all-reduce against a backward pass of
  milliseconds: the measured CCR is far above 1 on any machine, so ``build_hook("covap",
  ratio="auto")`` must reach K > 1 by itself (capped by ``max_ratio``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import cluster_skip_reason, run_ranks
from small_mlp import backward_step, make_model
from gradsync.algorithms import build_hook
from gradsync.algorithms.covap import AUTO_ADAPT_EVERY, CovapState
from gradsync.compressors.covap_shards import AUTO_MAX_RATIO, ratio_for_ccr

SRC = Path(__file__).resolve().parent.parent / "src"


def _auto_run(rank, world, steps, explicit_ccr, max_ratio=None):
    module = make_model()
    model = DDP(module, bucket_cap_mb=0.01)
    state, hook = build_hook("covap", model=module, ratio="auto", max_ratio=max_ratio)
    if explicit_ccr is not None:
        state.calibrate(explicit_ccr)  # as train/bench do after their warm-up
    model.register_comm_hook(state, hook)
    ks, calibrated = [], []
    for step in range(steps):
        backward_step(model, rank, step)
        ks.append(state.ratio)
        calibrated.append(state.filter.calibrated)
    return ks, calibrated, state.stats(), state.config()


def test_auto_calibrates_itself_from_its_first_iterations():
    steps = 8
    results = run_ranks(_auto_run, 2, steps, None, timeout=120)
    (ks0, cal0, stats0, cfg0), (ks1, cal1, stats1, _) = results
    state = CovapState(ratio="auto")
    t_cal = state.calibration_iter  # 4: iterations 1-3 timed
    assert state.adapter.adapt_every == AUTO_ADAPT_EVERY
    # iteration i's first hook call decides; after step i (iteration i+1 begins next) ...
    assert cal0 == cal1 == [False] * t_cal + [True] * (steps - t_cal)
    assert ks0 == ks1, "every rank uses the same K"
    assert stats0["covap_ccr"] == stats1["covap_ccr"] >= 0
    assert ks0[-1] == stats0["covap_k"] == ratio_for_ccr(stats0["covap_ccr"], AUTO_MAX_RATIO)
    assert cfg0["ratio"] != "auto" and cfg0["adapt_every"] == AUTO_ADAPT_EVERY


def _wrap_run(rank, world):
    import gradsync

    module = make_model()
    ddp = gradsync.wrap(module, torch.optim.SGD(module.parameters(), lr=0.01), "covap", bucket_cap_mb=0.01,
                        ratio="auto")
    for step in range(6):
        backward_step(ddp, rank, step)
    state = ddp.gradsync_state
    return state.filter.calibrated, state.ratio, state.stats()["covap_ccr"]


def test_wrap_calibrates_auto_too():
    r0, r1 = run_ranks(_wrap_run, 2, timeout=120)
    assert r0 == r1 and r0[0] and r0[1] == ratio_for_ccr(r0[2], AUTO_MAX_RATIO)


def _wrap_dear_covap_auto(rank, world):
    import gradsync

    module = make_model()
    with pytest.raises(ValueError, match="ratio='auto' of dear-covap needs the measured"):
        gradsync.wrap(module, torch.optim.SGD(module.parameters(), lr=0.01), "dear-covap", ratio="auto")
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def test_wrap_refuses_auto_where_it_cannot_calibrate():
    """dear-covap's ``auto`` needs a CCR that DeAR does not measure: wrap says so (and leaves no hook)."""
    assert run_ranks(_wrap_dear_covap_auto, 2, timeout=120) == [0, 0]


def test_explicit_calibration_is_kept():
    """train/bench calibrate after their warm-up: the hook must not calibrate a second time."""
    results = run_ranks(_auto_run, 2, 8, 2.5, 32, timeout=120)
    for ks, calibrated, stats, _ in results:
        assert ks == [3] * 8 and all(calibrated)  # ceil(2.5), not what loopback's own timing would give
        assert "covap_ccr" not in stats  # no decision was taken (no all-reduce of the window)


# --------------------------------------------------------------------------------------------
# Emulated cluster: real timings at low bandwidth
# --------------------------------------------------------------------------------------------
_RANK_SCRIPT = textwrap.dedent("""
    import datetime, json, os
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradsync.algorithms import build_hook
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    widths = [int(w) for w in os.environ["WIDTHS"].split(",")]
    module = nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())][:-1])
    model = DDP(module, bucket_cap_mb=0.25)
    state, hook = build_hook("covap", model=module, ratio="auto", max_ratio=int(os.environ["MAX_RATIO"]),
                             cast=os.environ["CAST"] or None)
    model.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(rank)
    ks = []
    for step in range(int(os.environ["STEPS"])):
        model.zero_grad(set_to_none=True)
        x, y = torch.randn(8, widths[0], generator=g), torch.randint(0, 10, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        ks.append(state.ratio)
    stats = state.stats()
    print("RESULT " + json.dumps({"ks": ks, "ccr": stats["covap_ccr"], "backward_s": stats["covap_backward_s"],
                                  "comm_s": stats["covap_comm_s"]}), flush=True)
    dist.barrier()
    del model, state, hook  # DDP and the hook state go before the process group, as gradsync's workers do
    import gc
    gc.collect()
    dist.destroy_process_group()
""")


@pytest.mark.skipif(cluster_skip_reason() is not None, reason=cluster_skip_reason() or "")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mbit, widths, cast", [
    (20.0, "256,512,256,10", ""),             # 0.30 M parameters, 1.2 MB
    (50.0, "1024,1024,512,10", "fp16"),       # 1.58 M parameters, 6.3 MB (issue 18, item 4); at 100 Mbit/s a
                                              # fresh-clone CI beside a 4-rank sweep measured CCR 1.48
])
def test_auto_reaches_k_above_1_by_itself_on_a_slow_network(mbit, widths, cast):
    from gradsync.cluster import EmulatedCluster
    from gradsync.comm.rendezvous import free_port

    steps, max_ratio = 8, 6
    with EmulatedCluster(2, mbit) as c:
        if not c.shaped:
            pytest.skip(f"emulated cluster unavailable: {c.reason}")
        port = str(free_port())
        procs = []
        for i in range(2):
            env = dict(os.environ, RANK=str(i), STEPS=str(steps), MAX_RATIO=str(max_ratio), WIDTHS=widths, CAST=cast,
                       MASTER_ADDR=c.address(0), MASTER_PORT=port, GLOO_SOCKET_IFNAME=c.ifname(i),
                       OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
            procs.append(c.popen(i, [sys.executable, "-c", _RANK_SCRIPT], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[7:]))
    print(f"\nauto on {mbit:g} Mbit/s, {widths}, cast {cast or 'none'}: CCR {outs[0]['ccr']:.1f} (comm {outs[0]['comm_s'] * 1e3:.0f} ms, backward "
          f"{outs[0]['backward_s'] * 1e3:.1f} ms), K per step {outs[0]['ks']}")
    assert outs[0]["ks"] == outs[1]["ks"] and outs[0]["ccr"] == outs[1]["ccr"]
    t_cal = CovapState(ratio="auto").calibration_iter
    # ~0.5 s per dense all-reduce (of the fp16 wire dtype at 50 Mbit/s) against a backward pass of a few ms
    # (measured up to 0.1 s with the cores shared by other jobs): CCR well above 1.5 on any machine,
    # so K = min(ceil(CCR), max_ratio) > 1 from the calibration on, on both ranks
    k = ratio_for_ccr(outs[0]["ccr"], max_ratio)
    assert outs[0]["ccr"] > 1.5 and k > 1
    assert outs[0]["ks"] == [1] * t_cal + [k] * (steps - t_cal)
