"""Lightning and Accelerate integrations on real 2-process CPU (Gloo) jobs.

Each framework runs one job on 2 ranks forked with the environment ``torchrun --nproc-per-node 2`` gives
(:func:`distributed.run_script_ranks`; the framework imported before the fork; the examples' test runs
real ``torchrun`` and ``accelerate launch``) that trains a small MLP on fixed synthetic data several
times in the same processes and writes per-rank JSON; the tests read it. Settings shared by all runs: 2 ranks, batch 16 per rank,
SGD(lr=0.05, momentum=0.9), DDP ``bucket_cap_mb=0.01`` (several buckets, so DDP's bucket rebuild after
the first iteration changes the layout as in a real model).

Tolerances: COVAP at K=1 sends the same averaged buckets as DDP's built-in all-reduce (divide by the
world size, then SUM), so per-step losses must agree to 1e-6 (observed: bitwise). COVAP at K=4 runs
``start_iter`` = 2 dense warm-up iterations, then each element is sent once every 4 iterations, so over
16 compressed iterations (a multiple of K) the bytes sent equal a quarter of the dense bytes up to
shard rounding (< 1 %).

``algorithm="auto"``: each framework's job also trains with ``"auto"`` (the choice depends on this
machine's load, so only what holds for any choice is checked: same entry on both ranks, a hook for the
framework's own buckets, finite losses, one line printed), resumes from its checkpoint (recorded choice,
nothing measured, the uninterrupted run's losses to 1e-6), and resumes with rank 1's checkpoint edited to
another choice (``ValueError`` on both ranks). The stdout of each job is kept as ``{job}.stdout``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

import pytest

from cli_runner import run_tree
from distributed import end_job

HERE = Path(__file__).resolve()
WORLD = 2
BATCH = 16
STEPS_PER_EPOCH = 6          # Lightning: optimizer steps per epoch per rank
BUCKET_CAP_MB = 0.01
K = 4
WARMUP = 2                   # CovapState.start_iter (dense iterations)
VOTE = 4                     # wire bytes of the finite vote (one float32) per compressed iteration at 2 ranks


# ------------------------------------------------------------------------------------------------
# Job code (runs inside the torchrun ranks)
# ------------------------------------------------------------------------------------------------
def _data(n: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 10, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, 10, generator=g)).argmax(1)
    return x, y


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _residual_sums(state) -> dict[str, float]:
    return {str(k): float(v.double().abs().sum()) for k, v in state.filter.memory.residuals.items()}


def _iteration_and_residuals(state) -> dict:
    """The hook state's iteration and (where it keeps error-feedback residuals, as COVAP) their sums."""
    out = {"iteration": state.stats()["iteration"]}
    if hasattr(state, "filter"):
        out["residuals"] = _residual_sums(state)
    if hasattr(state, "phase"):  # online auto: where it stands, and the step it measures from
        out.update(phase=state.phase, choice=state.choice, start=state.start)
    return out


def _lightning_job(out: Path) -> None:
    from gradsync.integrations.lightning import GradsyncHook  # first: makes torchvision importable

    import lightning.pytorch as L  # noqa: I001
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    x, y = _data(WORLD * BATCH * STEPS_PER_EPOCH)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()
            self.losses: list[float] = []

        def training_step(self, batch, _):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Probe(Callback):
        """Records the hook state the resumed fit starts training with."""

        def __init__(self, hook):
            self.hook, self.seen = hook, None

        def on_train_start(self, trainer, pl_module):
            s = self.hook.state
            self.seen = {"iteration": s.iteration, "residuals": _residual_sums(s),
                         "device": str(next(iter(s.filter.memory.residuals.values())).device)}

    def fit(callbacks, epochs, ckpt_path=None, checkpoint=False, bucket_cap_mb=BUCKET_CAP_MB, model=None):
        model = model or Net()
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, max_epochs=epochs, callbacks=callbacks,
            strategy=DDPStrategy(bucket_cap_mb=bucket_cap_mb, process_group_backend="gloo"),
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=checkpoint, num_sanity_val_steps=0)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return model.losses

    result: dict = {}
    result["plain"] = fit([], 2)
    k1 = GradsyncHook("covap", ratio=1)
    result["k1"] = fit([k1], 2)
    result["k1_stats"] = k1.stats()

    # the same module fitted twice with ratio=auto (whose state puts a timing forward hook on the
    # module): forward hooks on the module during each fit and after both
    class HookCount(Callback):
        def __init__(self):
            self.counts: list[int] = []

        def on_train_start(self, trainer, pl_module):
            self.counts.append(len(pl_module._forward_hooks))

    twice, count = Net(), HookCount()
    for _ in range(2):
        fit([GradsyncHook("covap", ratio="auto"), count], 1, model=twice)
    result["forward_hooks"] = count.counts + [len(twice._forward_hooks)]

    # Uninterrupted K=4 run of 3 epochs, checkpointing after every epoch, then a resume from the end of
    # epoch 2 (12 iterations) with a fresh model, trainer and DDP; with several DDP buckets ("" keys)
    # and with one bucket (DDP's default 25 MB cap, "single_" keys); "control_": one bucket at K=1 (all
    # residuals zero, so where the restored residuals land cannot matter).
    for prefix, cap, ratio in (("", BUCKET_CAP_MB, K), ("single_", 25.0, K), ("control_", 25.0, 1)):
        k4 = GradsyncHook("covap", ratio=ratio)
        ckpt = ModelCheckpoint(dirpath=str(out / f"{prefix}ckpt"), save_top_k=-1, every_n_epochs=1,
                               filename="{epoch}")
        result[prefix + "k4"] = fit([k4, ckpt], 3, checkpoint=True, bucket_cap_mb=cap)
        result[prefix + "k4_stats"] = k4.stats()
        hook = GradsyncHook("covap", ratio=ratio)
        probe = Probe(hook)
        try:
            result[prefix + "resumed"] = fit([hook, probe], 3, bucket_cap_mb=cap,
                                             ckpt_path=str(out / f"{prefix}ckpt" / "epoch=1.ckpt"))
            result[prefix + "resumed_stats"] = hook.stats()
        except Exception as exc:  # recorded for the test, which names the defect
            result[prefix + "resume_error"] = f"{type(exc).__name__}: {exc}"
        result[prefix + "resume_seen"] = probe.seen
    rank = int(os.environ["RANK"])
    _lightning_auto(out, rank, fit, result)
    (out / f"lightning_rank{rank}.json").write_text(json.dumps(result))
    end_job()


def _auto_record(result: dict, key: str, choice, stats: dict) -> None:
    """What an ``algorithm="auto"`` run chose: entry, whether it measured, where the choice came from."""
    result[key + "_entry"] = choice.entry
    result[key + "_measured"] = choice.decision is not None
    result[key + "_source"] = choice.source
    result[key + "_stats"] = stats


def _recorded_differently(payload: dict, entry: str) -> dict:
    """``payload`` with another recorded auto choice than ``entry`` (what rank 1 resumes from in the
    mismatch runs)."""
    return {**payload, "auto_entry": "fp16" if entry != "fp16" else "allreduce"}


def _lightning_auto(out: Path, rank: int, fit, result: dict) -> None:
    """GradsyncHook("auto"): a measured fit of 2 epochs (checkpoint after each), the same fit with the
    chosen entry as a fixed algorithm, a resume from epoch 0 (no measuring), and a resume where rank 1's
    checkpoint recorded another choice (must fail on both ranks)."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gradsync.algorithms import parse_entry
    from gradsync.integrations.lightning import GradsyncHook

    auto = GradsyncHook("auto")
    ckpt = ModelCheckpoint(dirpath=str(out / "auto_ckpt"), save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    result["auto"] = fit([auto, ckpt], 2, checkpoint=True)
    _auto_record(result, "auto", auto.auto, auto.stats())
    name, options = parse_entry(auto.auto.entry)
    result["auto_fixed"] = fit([GradsyncHook(name, **options)], 2)
    resumed = GradsyncHook("auto")
    result["auto_resumed"] = fit([resumed], 2, ckpt_path=str(out / "auto_ckpt" / "epoch=0.ckpt"))
    _auto_record(result, "auto_resumed", resumed.auto, resumed.stats())
    path = out / "auto_ckpt" / "epoch=0.ckpt"
    if rank == 1:
        ckpt1 = torch.load(path, weights_only=True)
        ckpt1["callbacks"]["GradsyncHook"] = _recorded_differently(ckpt1["callbacks"]["GradsyncHook"],
                                                                   auto.auto.entry)
        path = out / "auto_ckpt_rank1.ckpt"
        torch.save(ckpt1, path)
    try:
        fit([GradsyncHook("auto")], 2, ckpt_path=str(path))
    except ValueError as exc:
        result["auto_mismatch_error"] = str(exc)
    dist.barrier()
    # online=True: decided on the fit's own steps; the decision and the winner's state go into the checkpoint
    online = GradsyncHook("auto", online=True, recheck_every=40)
    ckpt = ModelCheckpoint(dirpath=str(out / "online_ckpt"), save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    result["online"] = fit([online, ckpt], 2, checkpoint=True)
    result["online_stats"] = online.stats()
    result["online_recheck_every"] = online.state.plan.recheck_every
    resumed = GradsyncHook("auto", online=True)
    result["online_resumed"] = fit([resumed], 2, ckpt_path=str(out / "online_ckpt" / "epoch=0.ckpt"))
    result["online_resumed_stats"] = resumed.stats()
    try:
        fit([GradsyncHook("auto", online=True)], 2, ckpt_path=str(out / "auto_ckpt" / "epoch=0.ckpt"))
    except ValueError as exc:
        result["online_foreign_error"] = str(exc)
    dist.barrier()


def _accelerate_auto(out: Path, rank: int, run, save_at: int, result: dict) -> None:
    """register_hook(model, "auto", ...): a measured run (saved at ``save_at``), its resume from that
    folder (no measuring), and a resume where rank 1's folder recorded another choice."""
    import shutil

    import torch
    import torch.distributed as dist

    auto = run({}, "auto", save_at=save_at, folder="acc_auto_ckpt")
    choice = auto.pop("choice")
    _auto_record(result, "auto", choice, auto["stats"])
    result["auto"] = auto
    folder = out / "acc_auto_ckpt"
    resumed = run({}, "auto", start=save_at, load_from=str(folder), resume=str(folder))
    _auto_record(result, "auto_resumed", resumed.pop("choice"), resumed["stats"])
    result["auto_resumed"] = resumed
    if rank == 1:
        copy = out / "acc_auto_ckpt_rank1"
        shutil.copytree(folder, copy)
        for path in copy.glob("custom_checkpoint_*.pkl"):
            torch.save(_recorded_differently(torch.load(path, weights_only=True), choice.entry), path)
        folder = copy
    try:
        run({}, "auto", start=save_at, load_from=str(folder), resume=str(folder))
    except ValueError as exc:
        result["auto_mismatch_error"] = str(exc)
    dist.barrier()
    # online=True: decided on the loop's own steps; the decision and the winner's state go into the checkpoint
    steps = WARMUP + 4 * K                        # the loop's optimizer steps
    result["online"] = run({}, "auto", save_at=save_at, folder="acc_online_ckpt", online=True, job_steps=steps)
    result["online_resumed"] = run({}, "auto", start=save_at, load_from=str(out / "acc_online_ckpt"), online=True,
                                   job_steps=steps)
    # without job_steps nothing limits the probe: saved after 4 optimizer steps, before any decision can be taken
    # (a start step, then 8 metered steps), unless there was nothing to measure; a resume then measures again
    result["online_open"] = run({}, "auto", save_at=8, folder="acc_online_open", online=True)
    result["online_open_resumed"] = run({}, "auto", start=8, load_from=str(out / "acc_online_open"), online=True)
    try:
        run({}, "auto", online=True, resume=str(out / "acc_online_ckpt"))
    except ValueError as exc:
        result["online_resume_error"] = str(exc)
    for key in ("online", "online_resumed", "online_open", "online_open_resumed"):
        result[key].pop("choice")


def _accelerate_job(out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from gradsync.integrations.accelerate import HookCheckpoint, register_hook

    torch.set_num_threads(1)
    accum, sync_steps = 2, WARMUP + 4 * K           # 18 optimizer steps, 16 of them compressed
    micro = accum * sync_steps
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum,
                              kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=BUCKET_CAP_MB)])
    rank, world = accelerator.process_index, accelerator.num_processes
    x, y = _data(world * BATCH * micro)
    xs, ys = x[rank::world], y[rank::world]      # this rank's samples, micro-batch i = rows i*BATCH...

    def run(record, algorithm=None, start=0, stop=micro, save_at=None, load_from=None, folder="acc_ckpt", **options):
        """Train micro-batches [start, stop); fills ``record`` as it goes (kept if training fails)."""
        accelerator._models.clear()             # this shared Accelerator saves/loads only this run's
        accelerator._optimizers.clear()         # model, optimizer and hook state
        accelerator._custom_objects.clear()
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = accelerator.prepare(model, opt)
        if algorithm == "auto":      # this rank's first 8 micro-batches, the loop's optimizer and loss
            batches = [(xs[i * BATCH:(i + 1) * BATCH], ys[i * BATCH:(i + 1) * BATCH]) for i in range(8)]
            if "resume" not in options:
                options = dict(options, optimizer=opt, batches=batches, loss_fn=F.cross_entropy)
            state, record["choice"] = register_hook(model, algorithm, **options)
            accelerator.register_for_checkpointing(
                HookCheckpoint(state, algorithm, accelerator.device, auto=record["choice"]))
        else:
            state = register_hook(model, algorithm, **options) if algorithm else None
            if state is not None:
                accelerator.register_for_checkpointing(HookCheckpoint(state, algorithm, accelerator.device))
        if load_from is not None:
            accelerator.load_state(load_from)
            record["restored"] = _iteration_and_residuals(state)
        record["losses"] = losses = []
        accelerator.step = start
        for i in range(start, stop):
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xs[i * BATCH:(i + 1) * BATCH]), ys[i * BATCH:(i + 1) * BATCH])
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            if save_at is not None and i + 1 == save_at:
                accelerator.save_state(str(out / folder))
                record["saved"] = _iteration_and_residuals(state)
        record["stats"] = state.stats() if state is not None else None
        return record

    result = {"plain": run({}), "k1": run({}, "covap", ratio=1)}
    save_at = micro - 2 * K                       # after 14 optimizer steps
    result["k4"] = run({}, "covap", ratio=K, save_at=save_at)
    result["resumed"] = {}
    try:
        run(result["resumed"], "covap", ratio=K, start=save_at, load_from=str(out / "acc_ckpt"))
    except Exception as exc:
        result["resume_error"] = f"{type(exc).__name__}: {exc}"
    _accelerate_auto(out, rank, run, save_at, result)
    (out / f"accelerate_rank{rank}.json").write_text(json.dumps(result))
    end_job()


# ------------------------------------------------------------------------------------------------
# Launch helpers and tests (pytest process)
# ------------------------------------------------------------------------------------------------
def _launch(job: str, out: Path, fn: Callable[[Path], None] | None = None, timeout: float = 240.0) -> list[dict]:
    """Run ``fn(out)`` (default: this file's ``job``) on 2 ranks forked as ``torchrun --nproc-per-node 2``
    would start them (:func:`distributed.run_script_ranks`, in ``out``, stdout to ``{job}.stdout``); read
    each rank's ``{job}_rank{r}.json``. The fixture imported the framework before."""
    from distributed import run_script_ranks

    run_script_ranks(fn or JOBS[job], WORLD, out, cwd=out, log=out / f"{job}.stdout", timeout=timeout)
    return [json.loads((out / f"{job}_rank{r}.json").read_text()) for r in range(WORLD)]


def _check_resume_error(record: dict) -> None:
    error = record.get("resume_error")
    assert error is None, error


def _quarter(stats: dict, iterations: int) -> None:
    """Wire bytes = WARMUP dense iterations + (iterations - WARMUP) / K dense iterations (< 1 %)."""
    assert stats["iteration"] == iterations
    per_iter = stats["dense_wire_bytes"] / iterations
    compressed_sent = stats["wire_bytes"] - WARMUP * per_iter
    compressed_dense = (iterations - WARMUP) * per_iter
    assert compressed_dense / compressed_sent == pytest.approx(K, rel=0.01)
    assert stats["compression_ratio"] > 2.5


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    pytest.importorskip("lightning", reason="needs the integrations extra: pip install gradsync[integrations]")
    import lightning.pytorch  # noqa: F401  (inherited by the forked ranks)

    out = tmp_path_factory.mktemp("lightning")
    return out, _launch("lightning", out)


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    pytest.importorskip("accelerate", reason="needs the integrations extra: pip install gradsync[integrations]")
    from accelerate import Accelerator  # noqa: F401  (inherited by the forked ranks)

    out = tmp_path_factory.mktemp("accelerate")
    return out, _launch("accelerate", out)


def test_lightning_covap_k1_matches_plain_ddp(lightning_runs):
    _, ranks = lightning_runs
    for r in ranks:
        assert len(r["plain"]) == 2 * STEPS_PER_EPOCH
        assert r["k1"] == pytest.approx(r["plain"], abs=1e-6, rel=0)
        # the hook really ran (on CPU, where DDPStrategy(ddp_comm_hook=...) registers nothing)
        assert r["k1_stats"]["iteration"] == 2 * STEPS_PER_EPOCH
        assert r["k1_stats"]["wire_bytes"] == r["k1_stats"]["dense_wire_bytes"] + VOTE * (2 * STEPS_PER_EPOCH - WARMUP)


def test_lightning_fit_twice_leaves_one_forward_hook(lightning_runs):
    """Each fit built a state that hooked the module's forward and never removed it: a second fit
    of the same module ran two timing hooks ([1, 2, 2]); the callback now removes its hook when
    the fit ends."""
    _, ranks = lightning_runs
    for r in ranks:
        assert r["forward_hooks"] == [1, 1, 0]


def test_lightning_covap_k4_sends_a_quarter(lightning_runs):
    _, ranks = lightning_runs
    for r in ranks:
        _quarter(r["k4_stats"], 3 * STEPS_PER_EPOCH)
        # losses follow dense DDP until the first compressed update has been applied, then differ
        assert r["k4"][:WARMUP + 1] == pytest.approx(r["plain"][:WARMUP + 1], abs=1e-6, rel=0)
        assert r["k4"][WARMUP + 1:2 * STEPS_PER_EPOCH] != pytest.approx(r["plain"][WARMUP + 1:], abs=1e-6, rel=0)


def test_lightning_checkpoint_saves_and_restores_hook_state(lightning_runs):
    import torch

    out, ranks = lightning_runs
    ckpt = torch.load(out / "ckpt" / "epoch=1.ckpt", weights_only=True)
    payload = ckpt["callbacks"]["GradsyncHook"]
    assert payload["algorithm"] == "covap" and payload["world_size"] == WORLD
    sums = []
    for rank, entry in enumerate(payload["ranks"]):
        assert entry["iteration"] == 2 * STEPS_PER_EPOCH and entry["filter"]["ratio"] == K
        residuals = entry["filter"]["memory"]["residuals"]
        assert len(residuals) == len(entry["layouts"]) >= 2
        sums.append({str(k): float(v.double().abs().sum()) for k, v in residuals.items()})
        assert all(s > 0 for s in sums[-1].values())
        # the resumed fit starts training with exactly this rank's restored state
        seen = ranks[rank]["resume_seen"]
        assert seen is not None, ranks[rank].get("resume_error")
        assert seen["iteration"] == 2 * STEPS_PER_EPOCH
        assert seen["residuals"] == pytest.approx(sums[-1], rel=1e-12)
        assert seen["device"] == "cpu"
    assert sums[0] != sums[1]   # residuals are per rank: both ranks' entries are kept


def test_lightning_resumed_run_continues_exactly(lightning_runs):
    _, ranks = lightning_runs
    for r in ranks:
        _check_resume_error(r)
        # the resumed epoch 3 repeats the uninterrupted run's epoch 3
        assert r["resumed"] == pytest.approx(r["k4"][2 * STEPS_PER_EPOCH:], abs=1e-6, rel=0)
        assert r["resumed_stats"]["iteration"] == 3 * STEPS_PER_EPOCH


def test_lightning_resume_continues_exactly_where_residuals_are_zero(lightning_runs):
    """Control for the resume tests: model, optimizer, loop and hook iteration resume exactly."""
    _, ranks = lightning_runs
    for r in ranks:
        assert "control_resume_error" not in r, r.get("control_resume_error")
        assert r["control_resume_seen"]["iteration"] == 2 * STEPS_PER_EPOCH
        assert set(r["control_resume_seen"]["residuals"].values()) == {0.0}
        assert r["control_resumed_stats"]["iteration"] == 3 * STEPS_PER_EPOCH
        assert r["control_resumed"] == pytest.approx(r["control_k4"][2 * STEPS_PER_EPOCH:], abs=1e-6, rel=0)
        assert r["control_k4"][:2 * STEPS_PER_EPOCH] == pytest.approx(r["plain"], abs=1e-6, rel=0)


def test_lightning_resumed_run_continues_exactly_with_one_bucket(lightning_runs):
    _, ranks = lightning_runs
    for r in ranks:
        assert "single_resume_error" not in r, r.get("single_resume_error")
        _quarter(r["single_k4_stats"], 3 * STEPS_PER_EPOCH)
        assert r["single_resume_seen"]["iteration"] == 2 * STEPS_PER_EPOCH
        assert r["single_resumed_stats"]["iteration"] == 3 * STEPS_PER_EPOCH
        assert r["single_resumed"] == pytest.approx(r["single_k4"][2 * STEPS_PER_EPOCH:], abs=1e-6, rel=0)


def test_accelerate_covap_k1_matches_plain_ddp_with_accumulation(accelerate_runs):
    _, ranks = accelerate_runs
    for r in ranks:
        assert r["k1"]["losses"] == pytest.approx(r["plain"]["losses"], abs=1e-6, rel=0)
        # the hook ran once per optimizer step (accumulation skips communication on the others)
        assert r["k1"]["stats"]["iteration"] == WARMUP + 4 * K
        assert r["k1"]["stats"]["wire_bytes"] == r["k1"]["stats"]["dense_wire_bytes"] + VOTE * 4 * K


def test_accelerate_covap_k4_sends_a_quarter_with_accumulation(accelerate_runs):
    _, ranks = accelerate_runs
    for r in ranks:
        _quarter(r["k4"]["stats"], WARMUP + 4 * K)


def test_accelerate_checkpoint_saves_and_restores_hook_state(accelerate_runs):
    _, ranks = accelerate_runs
    for r in ranks:
        saved, restored = r["k4"]["saved"], r["resumed"].get("restored")
        assert restored is not None, r.get("resume_error")
        assert saved["iteration"] == restored["iteration"] == WARMUP + 3 * K
        assert restored["residuals"] == pytest.approx(saved["residuals"], rel=1e-12)
        assert all(v > 0 for v in saved["residuals"].values())
    assert ranks[0]["k4"]["saved"]["residuals"] != ranks[1]["k4"]["saved"]["residuals"]


def test_accelerate_resumed_run_continues_exactly(accelerate_runs):
    _, ranks = accelerate_runs
    for r in ranks:
        _check_resume_error(r)
        assert r["resumed"]["losses"] == pytest.approx(r["k4"]["losses"][-2 * K:], abs=1e-6, rel=0)
        assert r["resumed"]["stats"]["iteration"] == WARMUP + 4 * K


# ------------------------------------------------------------------------------------------------
# algorithm="auto" (the choice depends on this machine's load: only what holds for any choice)
# ------------------------------------------------------------------------------------------------
def check_auto_run(out: Path, job: str, ranks: list[dict], losses: Callable[[dict], list], iterations: int) -> str:
    """Both ranks measured, chose the same hook (one that works on the framework's own DDP buckets),
    trained ``iterations`` hook iterations to finite losses, and rank 0 printed one line saying what it
    chose and what measuring cost; returns the entry."""
    import math

    from gradsync.profiler.advise import is_hook

    entry = ranks[0]["auto_entry"]
    for r in ranks:
        assert r["auto_entry"] == entry and r["auto_measured"] and r["auto_source"] == "measured"
        assert r["auto_stats"]["iteration"] == iterations
        assert losses(r) and all(math.isfinite(v) for v in losses(r))
    assert is_hook(entry, any_buckets=True)
    # (searched in the whole output: the other rank's writes may cut into a line)
    text = (out / f"{job}.stdout").read_text()
    measured = re.findall(r"gradsync auto: (\S+): [^\n]*\(measuring took \d+\.\d s\)", text)
    assert measured == [entry], text[-3000:]
    return entry


def check_auto_resume(out: Path, job: str, ranks: list[dict], entry: str, source: str) -> None:
    """Both ranks took ``entry`` from the checkpoint ``source`` ends with, measured nothing (rank 0 said
    so, once), and both refused a resume where rank 1's checkpoint recorded another choice."""
    for r in ranks:
        assert r["auto_resumed_entry"] == entry and not r["auto_resumed_measured"]
        assert r["auto_resumed_source"].endswith(source)
        error = r.get("auto_mismatch_error", "")
        assert "recorded different choices" in error and f"rank 0: {entry!r}" in error, error
    text = (out / f"{job}.stdout").read_text()
    assert text.count(f"gradsync auto: {entry}: the choice recorded in ") == 1, text[-3000:]
    assert text.count("gradsync auto: ") == 2, text[-3000:]   # that line and the measured run's


def test_lightning_auto_chooses_alike_trains_as_its_choice_and_resumes_without_measuring(lightning_runs):
    out, ranks = lightning_runs
    entry = check_auto_run(out, "lightning", ranks, lambda r: r["auto"], 2 * STEPS_PER_EPOCH)
    for r in ranks:
        # the hook registered is the chosen one, and measuring left model and RNG as they were
        assert r["auto"] == pytest.approx(r["auto_fixed"], abs=1e-6, rel=0)
        # the resumed epoch 2 repeats the uninterrupted run's (state restored into the same hook)
        assert r["auto_resumed"] == pytest.approx(r["auto"][STEPS_PER_EPOCH:], abs=1e-6, rel=0)
        assert r["auto_resumed_stats"]["iteration"] == 2 * STEPS_PER_EPOCH
    check_auto_resume(out, "lightning", ranks, entry, "epoch=0.ckpt")


def test_lightning_online_auto_resumes_its_decision(lightning_runs):
    """GradsyncHook("auto", online=True): with the fit's 12 steps as its job the budget pays for no race, so every
    rank settles on its lossless base after the start step; the epoch-0 checkpoint holds that decision and the resumed
    fit keeps it and repeats the uninterrupted fit's epoch 2. A checkpoint of the start-up probe's "auto" is
    refused on both ranks."""
    check_online_resume(lightning_runs[1], STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)
    # recheck_every reaches the plan (a lossless choice is never re-checked: the run is the same)
    assert all(r["online_recheck_every"] == 40 for r in lightning_runs[1])


def check_online_resume(ranks: list[dict], saved_at: int, steps: int) -> None:
    """A framework's ``"auto", online=True`` runs (``online``: saved after ``saved_at`` of ``steps`` steps;
    ``online_resumed``: resumed there; ``online_foreign_error``: a resume from the start-up probe's checkpoint):
    every rank settled on the same lossless base, kept it on resume, repeated the losses and refused the foreign
    checkpoint."""
    choice = ranks[0]["online_stats"]["auto_choice"]
    assert choice in ("allreduce", "fp16", "bf16")
    for r in ranks:
        assert r["online_stats"]["auto_choice"] == r["online_resumed_stats"]["auto_choice"] == choice
        assert r["online_resumed"] == pytest.approx(r["online"][saved_at:], abs=1e-6, rel=0)
        assert r["online_stats"]["iteration"] == r["online_resumed_stats"]["iteration"] == steps
        assert "resumes only from its own checkpoints" in r["online_foreign_error"]


def test_accelerate_auto_chooses_alike_and_resumes_without_measuring(accelerate_runs):
    out, ranks = accelerate_runs
    entry = check_auto_run(out, "accelerate", ranks, lambda r: r["auto"]["losses"], WARMUP + 4 * K)
    for r in ranks:
        assert r["auto_resumed"]["restored"]["iteration"] == r["auto"]["saved"]["iteration"] == WARMUP + 3 * K
        assert r["auto_resumed"]["losses"] == pytest.approx(r["auto"]["losses"][-2 * K:], abs=1e-6, rel=0)
        assert r["auto_resumed_stats"]["iteration"] == WARMUP + 4 * K
    check_auto_resume(out, "accelerate", ranks, entry, "custom_checkpoint_0.pkl")


def test_accelerate_online_auto_resumes_its_decision_or_measures_again(accelerate_runs):
    """register_hook(model, "auto", ..., online=True). With the loop's 18 steps as ``job_steps`` its budget pays
    for no race, so every rank settles on its lossless base after the start step; HookCheckpoint saves that decision
    with the hook's state and the resumed run (registered the same way, then accelerator.load_state) keeps it and
    repeats the uninterrupted run's steps. Without ``job_steps``, saved after 4 optimizer steps: the probe is still
    measuring there (no choice saved) and the resumed run measures again from the saved step, or, where the
    start-up measurements left nothing to measure (the loopback's CCR under load), it had settled on its base and
    the resume keeps that; alike on both ranks either way."""
    _, ranks = accelerate_runs
    choice = ranks[0]["online"]["stats"]["auto_choice"]
    assert choice in ("allreduce", "fp16", "bf16")
    saved_choice = ranks[0]["online_open"]["saved"]["choice"]
    for r in ranks:
        saved, restored = r["online_open"]["saved"], r["online_open_resumed"]["restored"]
        assert saved["iteration"] == restored["iteration"] == 4 and saved["choice"] == saved_choice
        if saved["phase"] == "settled":
            assert restored["phase"] == "settled" and restored["choice"] == saved_choice
        else:
            assert saved_choice is None and restored["start"] == 4
        assert r["online_open_resumed"]["stats"]["auto_choice"] == ranks[0]["online_open_resumed"]["stats"]["auto_choice"]
        assert r["online_open_resumed"]["stats"]["iteration"] == WARMUP + 4 * K
        assert "takes no resume=" in r["online_resume_error"]
        online, resumed = r["online"], r["online_resumed"]
        assert online["stats"]["auto_choice"] == resumed["stats"]["auto_choice"] == choice
        assert resumed["restored"]["iteration"] == online["saved"]["iteration"] == WARMUP + 3 * K
        assert resumed["losses"] == pytest.approx(online["losses"][-2 * K:], abs=1e-6, rel=0)
        assert resumed["stats"]["iteration"] == online["stats"]["iteration"] == WARMUP + 4 * K


def _disagree(rank, world):
    from gradsync.integrations.auto import agree_auto_entry

    messages = []
    for recorded, problem in ((["fp16", "fp16"][rank], None), (["fp16", None][rank], None),
                              ("fp16", [None, "a fixed algorithm's state"][rank]), (None, None)):
        try:
            messages.append(agree_auto_entry(recorded, problem))
        except ValueError as exc:
            messages.append(f"ValueError: {exc}")
    return messages


def test_auto_resume_agreement_fails_on_every_rank_where_one_differs():
    """Unit test of the agreement every integration runs before taking a recorded choice: same ->
    taken; another or none on one rank, or a rank that cannot read an auto choice -> ValueError on
    both ranks (no rank left waiting in a collective); none anywhere -> None (measure)."""
    from distributed import run_ranks

    from gradsync.integrations.auto import recorded_auto_entry

    for same, other, problem, none in run_ranks(_disagree, 2, timeout=120, pg_timeout=30):
        assert same == "fp16" and none is None
        assert other.startswith("ValueError") and "rank 0: 'fp16', rank 1: None" in other
        assert problem.startswith("ValueError") and "rank 1: a fixed algorithm's state" in problem
    assert recorded_auto_entry(None) == (None, None) and recorded_auto_entry({}) == (None, None)
    payload = {"format": 1, "algorithm": "auto", "auto_entry": "fp16", "world_size": 2, "ranks": [{}, {}]}
    assert recorded_auto_entry(payload) == ("fp16", None)
    entry, problem = recorded_auto_entry({**payload, "algorithm": "covap"})
    assert entry is None and "'covap'" in problem


# ------------------------------------------------------------------------------------------------
# Examples, launched with the commands their docstrings give (synthetic data, a few steps)
# ------------------------------------------------------------------------------------------------
EXAMPLES = HERE.parent.parent / "examples"


@pytest.mark.parametrize("launcher,script,args,needs", [
    ("torchrun", "torchrun_covap.py", ["--synthetic", "--steps", "12"], None),
    ("python", "lightning_covap.py", ["--synthetic", "--max-steps", "12"], "lightning"),
    ("accelerate", "accelerate_covap.py", ["--synthetic", "--steps", "24"], "accelerate"),
    ("torchrun", "transformers_covap.py", ["--steps", "12", "--layers", "1", "--embd", "32", "--batch-size", "4",
                                           "--seq-len", "32", "--save-steps", "100"], "transformers"),
])
def test_example_runs_on_two_cpu_processes_and_compresses(tmp_path, launcher, script, args, needs):
    if needs:
        pytest.importorskip(needs, reason="needs the integrations extra: pip install gradsync[integrations]")
    if script == "transformers_covap.py":
        from test_kjv import HAVE_KJV

        if not HAVE_KJV:
            pytest.skip("KJV text not installed (apt-get install bible-kjv-text)")
    from gradsync.comm.rendezvous import free_port

    # unbuffered: each print is one write, so the ranks' summary lines cannot be cut by the other
    # rank's block-buffered output (the Trainer's logs fill more than a pipe's atomic 4 KiB)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent.parent / "src"), env.get("PYTHONPATH", "")) if p)
    target = [str(EXAMPLES / script), *args]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), *target]
    elif launcher == "accelerate":   # the documented CPU command: --multi_gpu, the script sets cpu=True
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), *target]
    else:                            # Lightning starts the second process itself
        env["MASTER_PORT"] = str(free_port())
        cmd = [sys.executable, *target, "--out", str(tmp_path / "ckpt")]
    proc = run_tree(cmd, env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # the two ranks' summary lines may interleave on the shared stdout (each line is written whole)
    found = dict(re.findall(r"rank (\d): covap put \d+ bytes on the wire, dense all-reduce \d+ "
                                r"\(compression ([\d.]+)x", proc.stdout))
    assert sorted(found) == ["0", "1"], proc.stdout[-2000:]
    assert all(2.5 < float(r) <= 4.0 for r in found.values()), found   # K=4 after 2 dense iterations


# ------------------------------------------------------------------------------------------------
# Error paths (no framework launch)
# ------------------------------------------------------------------------------------------------
def _register_on_plain_module(rank, world):
    import torch

    from gradsync.integrations.accelerate import register_hook

    try:
        register_hook(torch.nn.Linear(4, 2), "covap", ratio=2)
    except ValueError as exc:
        return str(exc)
    return None


def test_accelerate_register_hook_refuses_an_unwrapped_model_in_a_multi_process_run():
    from distributed import run_ranks

    messages = run_ranks(_register_on_plain_module, 2, timeout=120, pg_timeout=60)
    assert all(m is not None and "Accelerator(cpu=True)" in m and "2 processes" in m for m in messages)


def test_accelerate_register_hook_warns_and_returns_none_in_one_process():
    import torch

    from gradsync.integrations.accelerate import register_hook

    with pytest.warns(UserWarning, match="single-process"):
        assert register_hook(torch.nn.Linear(4, 2), "covap", ratio=2) is None


def test_lightning_hook_warns_and_registers_nothing_in_one_process(tmp_path):
    pytest.importorskip("lightning", reason="needs the integrations extra: pip install gradsync[integrations]")
    from gradsync.integrations.lightning import GradsyncHook  # first: makes torchvision importable

    import lightning.pytorch as L  # noqa: I001
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, _):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    hook = GradsyncHook("covap", ratio=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[hook], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="single-process"):
        trainer.fit(Net(), DataLoader(TensorDataset(*_data(64)), batch_size=16))
    assert hook.state is None and hook.stats() == {}
    with pytest.raises(ValueError, match="ratio"):
        GradsyncHook("covap", ratio=0).setup(type("T", (), {"world_size": 2})(), None, "fit")


def test_integrations_refuse_dear_and_bad_options():
    from gradsync.integrations import build_state_and_hook

    with pytest.raises(ValueError, match="gradsync.wrap"):
        build_state_and_hook("dear")
    with pytest.raises(ValueError, match="ratio"):
        build_state_and_hook("covap", ratio=33)


def test_recheck_every_needs_online_in_every_integration():
    from gradsync.integrations.auto import online_options

    options = {"online": True, "recheck_every": 50, "other": 1}
    assert online_options(options) == (True, 50) and options == {"other": 1}
    assert online_options({}) == (False, 0)
    with pytest.raises(ValueError, match="recheck_every needs online=True"):
        online_options({"recheck_every": 5})
    with pytest.raises(ValueError, match=r"recheck_every must be an integer in \[0, 1000000\]"):
        online_options({"online": True, "recheck_every": -1})
    for module, cls in (("gradsync.integrations.lightning_callback", "GradsyncHook"),
                        ("gradsync.integrations.transformers_callback", "GradsyncCallback")):
        hook = getattr(pytest.importorskip(module), cls)
        assert hook("auto", online=True, recheck_every=50).recheck_every == 50
        with pytest.raises(ValueError, match="recheck_every needs online=True"):
            hook("auto", recheck_every=50)


def test_load_hook_state_refuses_other_algorithm_world_size_or_format():
    from gradsync.algorithms.covap import CovapState
    from gradsync.integrations import gather_hook_state, load_hook_state

    state = CovapState(ratio=4)
    state.iteration = 7
    payload = gather_hook_state("covap", state)       # one process: world size 1
    fresh = CovapState(ratio=4)
    load_hook_state("covap", fresh, payload, device="cpu")
    assert fresh.iteration == 7
    with pytest.raises(ValueError, match="algorithm 'covap'"):
        load_hook_state("topk", fresh, payload)
    with pytest.raises(ValueError, match="3 ranks"):
        load_hook_state("covap", fresh, {**payload, "world_size": 3})
    with pytest.raises(ValueError, match="format"):
        load_hook_state("covap", fresh, {"iteration": 7})


JOBS = {"lightning": _lightning_job, "accelerate": _accelerate_job}
