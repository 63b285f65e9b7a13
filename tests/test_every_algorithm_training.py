"""Every registered algorithm in a real training job: a run resumed from a mid-run checkpoint
continues the uninterrupted run's losses exactly, and bf16 autocast / fp16 with GradScaler and
gradient clipping train (finite losses, parameters identical on every rank)."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from every_algorithm import batches, build_small, installed_algorithms

from gradsync.algorithms import Precision
from gradsync.train import checkpoint as C
from gradsync.train.config import TrainConfig

STEPS, CUT = 8, 4


def _train(dp, sched, data, losses):
    for x, y in data:
        losses.append(dp.train_step(x, y, F.cross_entropy).item())
        sched.step()
        dp.observe_step(0.08, 8)  # the same "measured" step time on every rank and in both runs


def _sched(dp):
    return torch.optim.lr_scheduler.OneCycleLR(dp.optimizer, max_lr=0.05, total_steps=STEPS)


def _resume_every_algorithm(rank, world, names, root):
    out = {}
    data = batches(rank, 2 + STEPS)
    warm, train = data[:2], data[2:]
    for name in names:
        cfg = TrainConfig(algorithm=name, resume=f"{root}/{name}")
        try:
            # uninterrupted run, checkpointed after step CUT as `gradsync train` does
            torch.manual_seed(1)
            dp = build_small(name)
            sched = _sched(dp)
            dp.warm_up(warm, F.cross_entropy)
            full: list[float] = []
            _train(dp, sched, train[:CUT], full)
            C.save_training_checkpoint(cfg.resume, cfg, dp, sched, epoch=0, epoch_step=CUT, step=CUT,
                                       train_seconds=0.0, iterations=[], epochs=[])
            _train(dp, sched, train[CUT:], full)
            dp.close()
            # a fresh process: new model and algorithm, other RNG state, warm-up, then the checkpoint
            torch.manual_seed(99)
            dp = build_small(name)
            sched = _sched(dp)
            dp.warm_up(warm, F.cross_entropy)
            ckpt = C.restore_training(cfg, dp, sched)
            C.set_rng_state(ckpt["rng"])
            resumed: list[float] = []
            _train(dp, sched, train[CUT:], resumed)
            dp.close()
            out[name] = {"full": full[CUT:], "resumed": resumed}
        except Exception as exc:  # noqa: BLE001 - reported per algorithm
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
        dist.barrier()
    return out


@pytest.mark.timeout(600)
def test_resumed_run_continues_the_uninterrupted_losses_for_every_algorithm(tmp_path):
    names = installed_algorithms()
    res = run_ranks(_resume_every_algorithm, 2, names, str(tmp_path), timeout=400, pg_timeout=60)
    for rank, r in enumerate(res):
        assert set(r) == set(names)
        errors = {n: v["error"] for n, v in r.items() if "error" in v}
        assert not errors, f"rank {rank}: {errors}"
        differ = {n: v for n, v in r.items() if v["full"] != v["resumed"]}
        assert not differ, f"rank {rank}: resumed losses differ (bitwise) from the uninterrupted run: {differ}"


def _amp_every_algorithm(rank, world, names):
    out = {}
    data = batches(rank, 5)
    for name in names:
        for amp in ("bf16", "fp16"):
            try:
                precision = Precision.from_names(amp, 1.0, torch.device("cpu"))
                dp = build_small(name, scaler=precision.scaler)  # as gradsync train builds it
                start = [p.detach().clone() for p in dp.module.parameters()]
                dp.warm_up(data[:2], F.cross_entropy)
                losses = [dp.train_step(x, y, F.cross_entropy, precision).item() for x, y in data]
                dp.flush()
                flat = torch.cat([p.detach().reshape(-1).float() for p in dp.module.parameters()])
                gathered = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(gathered, flat)
                moved = max((p.detach() - s).abs().max().item() for p, s in zip(dp.module.parameters(), start))
                out[f"{name}/{amp}"] = {
                    "finite": all(math.isfinite(v) for v in losses),
                    "same_on_every_rank": all(torch.equal(g, gathered[0]) for g in gathered),
                    "moved": moved,
                }
                dp.close()
            except Exception as exc:  # noqa: BLE001 - reported per algorithm
                out[f"{name}/{amp}"] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
            dist.barrier()
    return out


@pytest.mark.timeout(600)
def test_bf16_autocast_and_fp16_grad_scaler_with_clipping_train_every_algorithm():
    names = installed_algorithms()
    res = run_ranks(_amp_every_algorithm, 2, names, timeout=400, pg_timeout=60)
    for rank, r in enumerate(res):
        assert len(r) == 2 * len(names)
        bad = {k: v for k, v in r.items()
               if "error" in v or not (v["finite"] and v["same_on_every_rank"] and v["moved"] > 0)}
        assert not bad, f"rank {rank}: {bad}"
