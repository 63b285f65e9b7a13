"""Hugging Face ``Trainer`` with :class:`gradsync.integrations.transformers.GradsyncCallback` on a real
2-process CPU (Gloo) job.

One job on 2 ranks forked as ``torchrun --nproc-per-node 2`` starts them (the Trainer imported first) trains a tiny GPT-2 built from a
config (1 layer, 32-dim embeddings, 2 heads, the 73 KJV characters as vocabulary, no dropout, no hub
download) on character windows of the KJV text several times in the same processes and writes per-rank
JSON: the Trainer without the callback, with COVAP K=1, with COVAP K=4 (checkpoint at step 6), and the
K=4 run resumed from that checkpoint by a fresh model and Trainer. Settings: 2 ranks, batch 4 x 32
characters per rank, AdamW lr 1e-3, gradient clipping at 1.0 (the Trainer's default), DDP
``ddp_bucket_cap_mb=0.01`` (several buckets), ``STEPS`` = 10 optimizer steps, logged every step (the
Trainer logs the loss averaged over both ranks).

Tolerances: COVAP at K=1 sends the same averaged buckets as DDP's all-reduce, so the losses must agree
to 1e-6 (observed: bitwise). At K=4 after ``WARMUP`` = 2 dense steps each element goes out once every
4 steps: the 8 compressed steps (a multiple of K) send exactly a quarter of the dense bytes plus the
finite vote (one float32 per step; this model's 5 buckets split into whole shards). The resumed run (model, optimizer, scheduler, RNG and data position
restored by the Trainer, hook state by the callback) repeats steps 7-10 of the uninterrupted run to
1e-6.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distributed import end_job
from test_integrations import (VOTE, K, WARMUP, _auto_record, _launch, _recorded_differently, check_auto_resume,
                               check_auto_run, check_online_resume)

STEPS = WARMUP + 2 * K          # 10 optimizer steps, 8 of them compressed
SAVE_AT = WARMUP + K            # checkpoint-6: residuals are non-zero there
SEQ, BATCH = 32, 4


# ------------------------------------------------------------------------------------------------
# Job code (runs inside the torchrun ranks)
# ------------------------------------------------------------------------------------------------
def _job(out: Path) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    from gradsync.integrations.transformers import HOOK_STATE_FILE, GradsyncCallback  # before transformers: torchvision
    from gradsync.workloads import kjv
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    text = kjv.read_text()[: 2 * BATCH * STEPS * SEQ + 1]
    ids = kjv.encode(text, kjv.KJV_VOCAB)
    windows = kjv.make_windows(ids, SEQ)[0]

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(windows)

        def __getitem__(self, i):
            return {"input_ids": windows[i], "labels": windows[i]}

    class Losses(TrainerCallback):
        def __init__(self):
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    def residual_sums(state) -> dict[str, float]:
        return {str(k): float(v.double().abs().sum()) for k, v in state.filter.memory.residuals.items()}

    class Probe(GradsyncCallback):
        """Records the hook state right after the callback registered (and, on resume, loaded) it."""

        seen = None

        def _on_forward(self, module, inputs):
            super()._on_forward(module, inputs)
            if self._ddp is not None and self.seen is None:
                self.seen = {"iteration": self.state.iteration, "residuals": residual_sums(self.state)}

    def train(name, sync=None, resume=None, save=False):
        torch.manual_seed(0)
        config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(kjv.KJV_VOCAB), n_positions=SEQ,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        args = TrainingArguments(
            output_dir=str(out / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
            learning_rate=1e-3, logging_steps=1, save_strategy="steps" if save else "no", save_steps=SAVE_AT,
            report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0,
            ddp_backend="gloo", ddp_bucket_cap_mb=0.01, ddp_find_unused_parameters=False)
        losses = Losses()
        trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Windows(),
                          callbacks=[losses] + ([sync] if sync is not None else []))
        trainer.train(resume_from_checkpoint=resume)
        return losses.losses

    result: dict = {"plain": train("plain")}
    k1 = GradsyncCallback("covap", ratio=1)
    result["k1"] = train("k1", k1)
    result["k1_stats"] = k1.stats()
    k4 = Probe("covap", ratio=K)
    result["k4"] = train("k4", k4, save=True)
    result["k4_stats"] = k4.stats()
    # resumed from the checkpoint, and from a copy of it without the hook state (a checkpoint written
    # without the callback): that one warns and starts a fresh hook state
    rank = dist.get_rank()
    if rank == 0:
        shutil.copytree(out / "k4" / f"checkpoint-{SAVE_AT}", out / "nohook" / f"checkpoint-{SAVE_AT}",
                        ignore=shutil.ignore_patterns(HOOK_STATE_FILE))
    dist.barrier()
    for name in ("k4", "nohook"):
        resumed = Probe("covap", ratio=K)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train(name, resumed, resume=str(out / name / f"checkpoint-{SAVE_AT}"))
        key = "resumed" if name == "k4" else "nohook"
        result[key] = losses
        result[key + "_warnings"] = [str(w.message) for w in caught if "GradsyncCallback" in str(w.message)]
        result[key + "_seen"] = resumed.seen
        result[key + "_stats"] = resumed.stats()
    try:
        train("bad", GradsyncCallback("covap", ratio=0))
    except ValueError as exc:
        result["bad_ratio"] = str(exc)
    result["hook_file"] = HOOK_STATE_FILE
    _auto(out, rank, train, result)
    (out / f"trainer_rank{rank}.json").write_text(json.dumps(result))
    end_job()


def _auto(out: Path, rank: int, train, result: dict) -> None:
    """GradsyncCallback("auto"): a measured run (checkpoint at SAVE_AT), its resume from that checkpoint
    (no measuring), and a resume where rank 1's checkpoint recorded another choice."""
    import torch
    import torch.distributed as dist

    from gradsync.integrations.transformers import HOOK_STATE_FILE, GradsyncCallback

    auto = GradsyncCallback("auto")
    result["auto"] = train("auto", auto, save=True)
    _auto_record(result, "auto", auto.auto, auto.stats())
    checkpoint = out / "auto" / f"checkpoint-{SAVE_AT}"
    resumed = GradsyncCallback("auto")
    result["auto_resumed"] = train("auto", resumed, resume=str(checkpoint))
    _auto_record(result, "auto_resumed", resumed.auto, resumed.stats())
    name = "auto"
    if rank == 1:                  # (the callback reads output_dir/checkpoint-N: rank 1 gets its own)
        name = "auto_rank1"
        copy = out / name / f"checkpoint-{SAVE_AT}"
        shutil.copytree(checkpoint, copy)
        payload = torch.load(copy / HOOK_STATE_FILE, weights_only=True)
        torch.save(_recorded_differently(payload, auto.auto.entry), copy / HOOK_STATE_FILE)
        checkpoint = copy
    try:
        train(name, GradsyncCallback("auto"), resume=str(checkpoint))
    except ValueError as exc:
        result["auto_mismatch_error"] = str(exc)
    dist.barrier()
    # online=True: decided on the run's own steps; the decision and the winner's state go into checkpoint-N
    online = GradsyncCallback("auto", online=True)
    result["online"] = train("online", online, save=True)
    result["online_stats"] = online.stats()
    resumed = GradsyncCallback("auto", online=True)
    result["online_resumed"] = train("online", resumed, resume=str(out / "online" / f"checkpoint-{SAVE_AT}"))
    result["online_resumed_stats"] = resumed.stats()
    try:
        train("auto", GradsyncCallback("auto", online=True), resume=str(out / "auto" / f"checkpoint-{SAVE_AT}"))
    except ValueError as exc:
        result["online_foreign_error"] = str(exc)
    dist.barrier()


# ------------------------------------------------------------------------------------------------
# Tests (pytest process)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs the integrations extra: pip install gradsync[integrations]")
    from test_kjv import HAVE_KJV

    if not HAVE_KJV:
        pytest.skip("KJV text not installed (apt-get install bible-kjv-text)")
    out = tmp_path_factory.mktemp("trainer")
    from transformers import Trainer  # noqa: F401  (inherited by the forked ranks)

    return out, _launch("trainer", out, _job)


def test_trainer_covap_k1_matches_the_trainer_without_callback(trainer_runs):
    _, ranks = trainer_runs
    for r in ranks:
        assert len(r["plain"]) == STEPS
        assert r["k1"] == pytest.approx(r["plain"], abs=1e-6, rel=0)
        assert r["k1_stats"]["iteration"] == STEPS          # the hook ran at every optimizer step


def test_trainer_covap_k4_sends_a_quarter_after_warmup(trainer_runs):
    _, ranks = trainer_runs
    for r in ranks:
        stats = r["k4_stats"]
        assert stats["iteration"] == STEPS
        dense_step = stats["dense_wire_bytes"] / STEPS
        # after the warm-up each step sends a quarter of the dense bytes, plus the 4-byte finite vote
        after_warmup = (stats["wire_bytes"] - WARMUP * dense_step) / (STEPS - WARMUP)
        assert after_warmup == dense_step / K + VOTE
        # dense until the first compressed update is applied, then a different trajectory
        assert r["k4"][:WARMUP + 1] == pytest.approx(r["plain"][:WARMUP + 1], abs=1e-6, rel=0)
        assert r["k4"][WARMUP + 1:] != pytest.approx(r["plain"][WARMUP + 1:], abs=1e-6, rel=0)


def test_trainer_checkpoint_holds_and_resume_restores_every_ranks_hook_state(trainer_runs):
    import torch

    out, ranks = trainer_runs
    payload = torch.load(out / "k4" / f"checkpoint-{SAVE_AT}" / ranks[0]["hook_file"], weights_only=True)
    assert payload["algorithm"] == "covap" and payload["world_size"] == 2 and payload["global_step"] == SAVE_AT
    sums = []
    for rank, entry in enumerate(payload["ranks"]):
        assert entry["iteration"] == SAVE_AT and entry["filter"]["ratio"] == K
        sums.append({str(k): float(v.double().abs().sum()) for k, v in entry["filter"]["memory"]["residuals"].items()})
        assert sum(s > 0 for s in sums[-1].values()) >= 2     # (a bucket whose shard just went out holds 0)
        seen = ranks[rank]["resumed_seen"]
        assert seen["iteration"] == SAVE_AT
        assert seen["residuals"] == pytest.approx(sums[-1], rel=1e-12)
        assert ranks[rank]["resumed_warnings"] == []
    assert sums[0] != sums[1]      # per-rank residuals: both entries kept


def test_trainer_resumed_run_continues_the_losses(trainer_runs):
    _, ranks = trainer_runs
    for r in ranks:
        assert r["resumed"] == pytest.approx(r["k4"][SAVE_AT:], abs=1e-6, rel=0)
        assert r["resumed_stats"]["iteration"] == STEPS


def test_trainer_resume_without_hook_state_warns_and_starts_fresh(trainer_runs):
    _, ranks = trainer_runs
    for r in ranks:
        assert len(r["nohook_warnings"]) == 1 and "no gradsync hook state" in r["nohook_warnings"][0]
        assert r["nohook_seen"]["iteration"] == 0 and set(r["nohook_seen"]["residuals"].values()) <= {0.0}
        assert r["nohook_stats"]["iteration"] == STEPS - SAVE_AT


def test_trainer_callback_refuses_bad_options_on_every_rank(trainer_runs):
    _, ranks = trainer_runs
    assert all("ratio" in r.get("bad_ratio", "") for r in ranks)


def test_trainer_auto_chooses_alike_and_resumes_without_measuring(trainer_runs):
    out, ranks = trainer_runs
    entry = check_auto_run(out, "trainer", ranks, lambda r: r["auto"], STEPS)
    for r in ranks:
        # the resumed steps repeat the uninterrupted run's (the chosen hook's state restored)
        assert r["auto_resumed"] == pytest.approx(r["auto"][SAVE_AT:], abs=1e-6, rel=0)
        assert r["auto_resumed_stats"]["iteration"] == STEPS
    check_auto_resume(out, "trainer", ranks, entry, f"checkpoint-{SAVE_AT}/gradsync_hook_state.pt")


def test_trainer_online_auto_resumes_its_decision(trainer_runs):
    """GradsyncCallback("auto", online=True): every rank settles alike (here on its lossless base: the run's steps
    as its job leave no budget for a race); checkpoint-N holds the decision and the resumed run keeps it and
    repeats the uninterrupted run's losses. A checkpoint of the start-up probe's "auto" is refused."""
    check_online_resume(trainer_runs[1], SAVE_AT, STEPS)


def test_callback_refuses_dear_and_warns_in_one_process():
    pytest.importorskip("transformers", reason="needs the integrations extra: pip install gradsync[integrations]")
    import torch

    from gradsync.integrations.transformers import GradsyncCallback  # before transformers: torchvision
    from transformers import TrainerControl, TrainerState, TrainingArguments

    with pytest.raises(ValueError, match="gradsync.wrap"):
        GradsyncCallback("dear")
    sync = GradsyncCallback("covap", ratio=4)
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.warns(UserWarning, match="single-process"):
        sync.on_train_begin(args, TrainerState(), TrainerControl(), model=torch.nn.Linear(2, 2))
    assert sync.state is None and sync.stats() == {}
