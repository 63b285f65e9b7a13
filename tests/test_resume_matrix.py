"""Issue 32's resume matrix: every registered algorithm, through each entry point, saved at step 3 and
loaded by a fresh process group of fresh processes, continues with the uninterrupted run's losses.

Per entry point two launches of 2 Gloo ranks on 127.0.0.1 (forked by :func:`distributed.run_ranks`;
for the frameworks forked with the environment ``torchrun`` gives, the framework imported before the
fork; one process per rank trains every algorithm in turn): the first trains every algorithm for :data:`STEPS` steps,
uninterrupted, checkpointing after step :data:`SAVE`; the second, a new process group of new
processes, loads every algorithm's checkpoint and trains steps 4-6. The losses of steps 4-6 (and the
parameters, or the evaluation, after step 6) must be bitwise equal: on CPU Gloo with one thread per
rank every algorithm's arithmetic is deterministic, the randomness (random-k, PowerSGD's and the
sketches' seeds, the data order) is in the checkpoint, and the options below keep wall-clock time out
of the decisions (GraVAC's plateau test compares measured throughputs: ``plateau_tolerance=0`` never
stops its search on them; COVAP's ``ratio`` is fixed). An entry point that refuses an algorithm on
purpose is checked for its clear refusal (a ``ValueError`` saying what to use instead) in its own
test.

Entry points: ``gradsync train``'s per-rank Python entry (:func:`gradsync.train.loop.run`, the
function every ``gradsync train`` rank runs, on the Fashion-MNIST workload, checkpoints through
``--checkpoint-every`` and ``--resume``), :func:`gradsync.wrap` (DDP + hook or DeAR's pipeline around
a bare module; the state saved and loaded as a user script does, ``torch.save`` /
``torch.load(weights_only=True)``), and, on every_algorithm's MLP and batches with DDP's
``bucket_cap_mb=0.01`` (the integrations refuse the algorithms in :data:`INTEGRATION_REFUSALS`): Accelerate (``register_hook`` + ``HookCheckpoint``,
``accelerator.save_state`` / ``load_state``), Lightning (``GradsyncHook``; 2 epochs of 3 steps,
``ModelCheckpoint`` after each epoch, ``trainer.fit(ckpt_path=...)`` from the first) and the Hugging
Face ``Trainer`` (``GradsyncCallback``; ``save_steps=3``, ``train(resume_from_checkpoint=...)``, the
Trainer skipping the 3 batches trained). The frameworks' rows compare the losses of steps 4-6, the
parameters after step 6 (their sum of squares in float64, printed exactly) and the wire and dense
bytes of steps 4-6 (the hook state's ``stats()``), bitwise. The CUDA rows are in
``tests/test_cuda_nccl.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from distributed import end_job, run_ranks, run_script_ranks
from every_algorithm import OPTIONS as SMALL_OPTIONS
from every_algorithm import installed_algorithms
from gradsync.algorithms import REGISTRY
from gradsync.workloads import fashion_mnist

NAMES = installed_algorithms()
STEPS, SAVE = 6, 3
#: every_algorithm's options (each algorithm compresses from its first steps), without timing in
#: the decisions (see the module docstring), the ladder checking its error every 2 steps
OPTIONS = {**SMALL_OPTIONS, "plateau_tolerance": 0.0, "check_every": 2}
#: algorithms whose wire bytes at steps 4-6 equal dense all-reduce's (nothing compressed)
DENSE = {"allreduce", "dear"}


def _options(name: str) -> dict:
    keys = REGISTRY[name].options.keys()
    return {k: v for k, v in OPTIONS.items() if k in keys}


def _errors(runs: dict) -> dict:
    return {n: r for n, r in runs.items() if isinstance(r, str)}


def _per_algorithm(names, run_one) -> dict:
    """``{name: run_one(name)}`` (left out where it returns None), or the error's type and message per
    algorithm; a barrier after each, so one failing algorithm leaves the ranks in step."""
    out = {}
    for name in names:
        try:
            result = run_one(name)
            if result is not None:
                out[name] = result
        except Exception as exc:  # noqa: BLE001 - recorded per algorithm
            out[name] = f"{type(exc).__name__}: {exc}"
        torch.distributed.barrier()
    return out


# ------------------------------------------------------------------------------------------ gradsync train
def _cli_job(rank, world, root, resume):
    """Every algorithm through ``gradsync train``'s rank function: 6 steps with a checkpoint after step 3,
    or (``resume``) the same run resumed from that checkpoint. Returns per algorithm the per-step
    losses (1-6; the resumed run's 1-3 are the checkpoint's log), the test loss after step 6 and the
    wire/dense bytes of the steps trained, or the error."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import run

    def one(name):
        cfg = TrainConfig(algorithm=name, options=_options(name), train_samples=320, batch_size=8,
                          max_steps=STEPS, eval_samples=16, compute_steps=1, bucket_cap_mb=0.01,
                          progress=False, checkpoint=f"{root}/{name}", checkpoint_every=None if resume else SAVE,
                          resume=f"{root}/{name}/step{SAVE}" if resume else None)
        with contextlib.redirect_stdout(io.StringIO()):
            res = run(cfg)
        if res is None:
            return None
        s = res["summary"]
        return {"losses": [i["loss"] for i in res["iterations"]], "test_loss": s["test_loss"],
                "ratio": s["compression_ratio"]}

    return _per_algorithm(NAMES, one)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    if not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    root = str(tmp_path_factory.mktemp("cli"))
    full = run_ranks(_cli_job, 2, root, False, timeout=300, pg_timeout=60)[0]
    part = run_ranks(_cli_job, 2, root, True, timeout=300, pg_timeout=60)[0]
    return full, part


@pytest.mark.parametrize("algorithm", NAMES)
def test_cli_resume_continues_the_uninterrupted_losses(cli_runs, algorithm):
    full, part = (runs.get(algorithm, "no result") for runs in cli_runs)
    assert not isinstance(full, str), f"gradsync train {algorithm}, uninterrupted: {full}"
    assert not isinstance(part, str), f"gradsync train {algorithm}, resumed: {part}"
    assert len(full["losses"]) == len(part["losses"]) == STEPS
    assert part["losses"][:SAVE] == full["losses"][:SAVE], "the resumed run's log holds the saved steps"
    assert part["losses"][SAVE:] == full["losses"][SAVE:], f"gradsync train {algorithm}: steps 4-6 differ"
    assert part["test_loss"] == full["test_loss"], f"gradsync train {algorithm}: the model after step 6 differs"
    if algorithm not in DENSE:  # the resumed steps compress: their state is what the checkpoint carried
        assert part["ratio"] > 1.05, part


# ------------------------------------------------------------------------------------------ gradsync.wrap
def _wrap_job(rank, world, root, resume):
    """Every algorithm through :func:`gradsync.wrap` on every_algorithm's MLP (several DDP buckets): 6
    steps saving after step 3 (hooks: model, optimizer and ``ddp.gradsync_state``; DeAR and other wrappers: their
    ``state_dict()``), or (``resume``) a fresh model and wrapper loading that and training steps 4-6.
    Returns per algorithm the losses of the steps trained, the parameters after step 6 and the wire and
    dense bytes of steps 4-6."""
    import torch.nn.functional as F

    import gradsync
    from every_algorithm import batches, load_wrapped, small_model, wrapped_checkpoint

    data = batches(rank, STEPS)

    def one(name):
        model = small_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        w = gradsync.wrap(model, opt, name, bucket_cap_mb=0.01, **_options(name))
        hook = hasattr(w, "gradsync_state")
        path = f"{root}/{name}.rank{rank}.pt"
        if resume:
            load_wrapped(model, opt, w, hook, torch.load(path, weights_only=True))
        def counters():
            stats = w.gradsync_state.stats() if hook else w.stats()
            return stats["wire_bytes"], stats["dense_wire_bytes"]

        losses, since = [], counters()
        for i in range(SAVE if resume else 0, STEPS):
            (opt if hook else w).zero_grad()
            loss = F.cross_entropy(w(data[i][0]), data[i][1])
            loss.backward()
            (opt if hook else w).step()
            losses.append(loss.item())
            if i + 1 == SAVE and not resume:
                torch.save(wrapped_checkpoint(model, opt, w, hook), path)
                since = counters()
        if not hook:
            w.flush()
        result = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                  "bytes": [b - a for a, b in zip(since, counters())]}  # wire and dense, steps 4-6
        getattr(w.gradsync_state if hook else w, "close", lambda: None)()
        return result

    return _per_algorithm(NAMES, one)


@pytest.fixture(scope="module")
def wrap_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("wrap"))
    full = run_ranks(_wrap_job, 2, root, False, timeout=240, pg_timeout=60)
    part = run_ranks(_wrap_job, 2, root, True, timeout=240, pg_timeout=60)
    return full, part


@pytest.mark.parametrize("algorithm", NAMES)
def test_wrap_resume_continues_the_uninterrupted_losses(wrap_runs, algorithm):
    for rank, (full, part) in enumerate(zip(*(
            [r.get(algorithm, "no result") for r in runs] for runs in wrap_runs))):
        assert not isinstance(full, str), f"gradsync.wrap {algorithm}, rank {rank}, uninterrupted: {full}"
        assert not isinstance(part, str), f"gradsync.wrap {algorithm}, rank {rank}, resumed: {part}"
        assert part["losses"] == full["losses"][SAVE:], f"gradsync.wrap {algorithm}, rank {rank}: steps 4-6 differ"
        same = [torch.equal(a, b) for a, b in zip(full["params"], part["params"])]
        assert all(same), f"gradsync.wrap {algorithm}, rank {rank}: parameters after step 6 differ ({same})"
        assert part["bytes"] == full["bytes"], f"gradsync.wrap {algorithm}, rank {rank}: steps 4-6 sent other bytes"
        if algorithm not in DENSE | {"ladder"}:  # (the ladder's quality checks add dense all-reduces)
            assert part["bytes"][1] > 1.05 * part["bytes"][0], part["bytes"]  # steps 4-6 compressed


# ------------------------------------------------------------------------------------------ Accelerate
#: refused on purpose by the integrations, with what the refusal names instead: the algorithms that
#: replace DDP (DeAR, ...: gradsync.wrap); torch's PowerSGD hook, which needs one DDP bucket on Gloo
#: (the job's DDP has several, bucket_cap_mb=0.01; it refuses at the first iteration with several)
INTEGRATION_REFUSALS = {**{n: "gradsync.wrap" for n in NAMES if REGISTRY[n].make_hook is None},
                        "powersgd": "bucket_cap_mb"}


def _accelerate_job(out: Path, resume: bool) -> None:
    """Every algorithm through Accelerate in this rank (see :func:`_wrap_job`); writes
    ``accelerate_{full,resumed}_rank{r}.json``: per algorithm the losses, the parameters' sum of
    squares (float64, printed exactly) and the wire/dense bytes of steps 4-6, or the error."""
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from every_algorithm import batches, small_model
    from gradsync.integrations.accelerate import HookCheckpoint, register_hook

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.01)])
    rank = accelerator.process_index
    data = batches(rank, STEPS)
    def one(name):
        accelerator._models.clear()  # this shared Accelerator saves/loads only this algorithm's objects
        accelerator._optimizers.clear()
        accelerator._custom_objects.clear()
        model = small_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        ddp, opt = accelerator.prepare(model, opt)
        state = register_hook(ddp, name, **_options(name))
        accelerator.register_for_checkpointing(HookCheckpoint(state, name, accelerator.device))
        if resume:
            accelerator.load_state(str(out / name))
        losses, since = [], None
        for i in range(SAVE if resume else 0, STEPS):
            if i == SAVE:
                since = state.stats()
            loss = F.cross_entropy(ddp(data[i][0]), data[i][1])
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if i + 1 == SAVE and not resume:
                accelerator.save_state(str(out / name))
        found = _found(losses, model, since, state.stats())
        state.close()
        return found

    _write_job(out, "accelerate", rank, resume, _per_algorithm(_job_names(resume), one))


def _job_names(resume: bool) -> list[str]:
    """What an integration job trains: every algorithm (the refused ones to record their refusal), and
    on resume those that trained."""
    return [n for n in NAMES if not (resume and n in INTEGRATION_REFUSALS)]


def _found(losses: list[float], model: torch.nn.Module, since: dict, now: dict) -> dict:
    """An integration job's record of one algorithm: the losses of the steps trained, the parameters'
    sum of squares after step 6 (float64, printed exactly) and the wire/dense bytes of steps 4-6
    (``since``: the hook state's ``stats()`` before step 4, ``now``: after step 6)."""
    return {"losses": losses, "params": repr(sum(float(p.double().pow(2).sum()) for p in model.parameters())),
            "bytes": [now[k] - since[k] for k in ("wire_bytes", "dense_wire_bytes")]}


def _write_job(out: Path, job: str, rank: int, resume: bool, result: dict) -> None:
    """Write this rank's ``{job}_{full,resumed}_rank{r}.json`` and shut the process group down."""
    (out / f"{job}_{'resumed' if resume else 'full'}_rank{rank}.json").write_text(json.dumps(result))
    end_job()


def _forked(job: str, out: Path, resume: bool) -> list[dict]:
    """Run ``job`` (full or ``resume``) on 2 ranks forked as ``torchrun`` starts them
    (:func:`distributed.run_script_ranks`; the fixture imported the framework first, so the ranks need
    not: Lightning ~5 s of CPU per rank); each rank's record."""
    kind = "resumed" if resume else "full"
    run_script_ranks(JOBS[job], 2, out, resume, cwd=out, log=out / f"{job}_{kind}.stdout")
    return [json.loads((out / f"{job}_{kind}_rank{r}.json").read_text()) for r in range(2)]


def _check_continues(runs: tuple[list[dict], list[dict]], job: str, algorithm: str) -> None:
    """Per rank: the resumed run's steps 4-6 have the uninterrupted run's losses, parameters after step 6
    and wire/dense bytes, bitwise."""
    for rank, (full, part) in enumerate(zip(*([r.get(algorithm, "no result") for r in rs] for rs in runs))):
        assert not isinstance(full, str), f"{job} {algorithm}, rank {rank}, uninterrupted: {full}"
        assert not isinstance(part, str), f"{job} {algorithm}, rank {rank}, resumed: {part}"
        assert len(full["losses"]) == STEPS, full["losses"]
        assert part["losses"] == full["losses"][SAVE:], f"{job} {algorithm}, rank {rank}: steps 4-6 differ"
        assert part["params"] == full["params"], f"{job} {algorithm}, rank {rank}: parameters after step 6 differ"
        assert part["bytes"] == full["bytes"], f"{job} {algorithm}, rank {rank}: steps 4-6 sent other bytes"


def _check_refusal(full: list[dict], job: str, algorithm: str) -> None:
    """The refusal is a ValueError naming what to use instead, on every rank (no hang: the next
    algorithm ran)."""
    for rank, r in enumerate(full):
        got = r.get(algorithm, "no result")
        assert isinstance(got, str) and "ValueError" in got and INTEGRATION_REFUSALS[algorithm] in got, \
            f"{job} {algorithm}, rank {rank}: {got}"


# ------------------------------------------------------------------------------------------ Lightning
def _lightning_job(out: Path, resume: bool) -> None:
    """Every algorithm through Lightning (``GradsyncHook``; ``DDPStrategy(bucket_cap_mb=0.01)``) in this
    rank: 2 epochs of 3 steps, ``ModelCheckpoint`` saving after each epoch, or (``resume``) a
    fresh module, hook and Trainer fitted from ``epoch=0.ckpt`` (saved after step 3). The rank's batches
    are :func:`every_algorithm.batches`, step i taking batch i (an end-of-epoch checkpoint: Lightning
    resumes it exactly without a stateful loader). Writes ``lightning_{full,resumed}_rank{r}.json`` as
    :func:`_accelerate_job` does."""
    from gradsync.integrations.lightning import GradsyncHook  # first: makes torchvision importable

    import lightning.pytorch as L  # noqa: I001
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Sampler

    from every_algorithm import batches, small_model

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")  # Lightning keeps a group it finds
    rank = torch.distributed.get_rank()
    data = batches(rank, STEPS)

    class Epochs(Sampler):
        """Epoch e takes batches ``SAVE * e`` onwards. Lazy (a generator): on resume Lightning creates the
        loader's iterator before it calls ``set_epoch``."""

        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return SAVE

        def __iter__(self):
            yield from range(SAVE * self.epoch, SAVE * (self.epoch + 1))

    class Net(L.LightningModule):
        def __init__(self, sync):
            super().__init__()
            self.net, self.sync = small_model(), sync
            self.losses, self.since = [], None

        def on_train_batch_start(self, batch, batch_idx):  # after the hook state was restored
            if self.global_step == SAVE:
                self.since = self.sync.stats()

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)

    def one(name):
        sync = GradsyncHook(name, **_options(name))
        module = Net(sync)
        saves = [] if resume else [ModelCheckpoint(dirpath=str(out / name), filename="{epoch}", save_top_k=-1,
                                                   every_n_epochs=1)]
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_epochs=STEPS // SAVE, callbacks=[sync, *saves],
            strategy=DDPStrategy(bucket_cap_mb=0.01, process_group_backend="gloo"), use_distributed_sampler=False,
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=not resume,
            num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, DataLoader(data, batch_size=None, sampler=Epochs()),
                    ckpt_path=str(out / name / "epoch=0.ckpt") if resume else None)
        return _found(module.losses, module.net, module.since, sync.stats())

    _write_job(out, "lightning", rank, resume, _per_algorithm(_job_names(resume), one))


# ------------------------------------------------------------------------------------------ HF Trainer
def _trainer_job(out: Path, resume: bool) -> None:
    """Every algorithm through the Hugging Face ``Trainer`` (``GradsyncCallback``; ``ddp_bucket_cap_mb=0.01``)
    in this rank: 6 steps (max_steps) saving ``checkpoint-3``, or (``resume``) a fresh model,
    callback and Trainer resumed from it. The model is :func:`every_algorithm.small_model` returning
    ``{"loss": ...}``; optimizer as :func:`_accelerate_job`'s (constant rate, no gradient clipping); the
    dataset holds every step's batch of rank 0, then of rank 1, read in order (``sequential``) so each rank
    gets :func:`every_algorithm.batches` as the other rows do. Writes ``trainer_{full,resumed}_rank{r}.json``
    as :func:`_accelerate_job` does."""
    import gc

    import torch.nn.functional as F

    from gradsync.integrations.transformers import GradsyncCallback  # first: makes torchvision importable
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments  # noqa: I001

    from every_algorithm import batches, small_model

    # each train() ends in a gc.collect() (Accelerate's free_memory) that walked every imported object
    # (0.36 s a run, 6 of the 9 s a launch spent in its jobs): imported objects stay, out of its sight
    gc.freeze()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    per_rank = [batches(r, STEPS) for r in range(2)]
    samples = [{"x": x, "labels": y} for i in range(STEPS) for r in range(2) for x, y in zip(*per_rank[r][i])]

    class Classifier(torch.nn.Module):
        def __init__(self, sync):
            super().__init__()
            self.net, self.sync = small_model(), sync
            self.losses, self.seen = [], []

        def forward(self, x, labels):
            loss = F.cross_entropy(self.net(x), labels)
            if self.training:  # (the callback registered and loaded the hook state before this forward)
                self.losses.append(loss.item())
                self.seen.append(self.sync.stats())
            return {"loss": loss}

    class SaveAtSave(TrainerCallback):
        """Save ``checkpoint-3`` only (not also at the last step)."""

        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = state.global_step == SAVE

    def one(name):
        sync = GradsyncCallback(name, **_options(name))
        model = Classifier(sync)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        args = TrainingArguments(
            output_dir=str(out / name), max_steps=STEPS, per_device_train_batch_size=len(per_rank[0][0][1]),
            train_sampling_strategy="sequential", lr_scheduler_type="constant", max_grad_norm=0.0,
            save_strategy="steps", save_steps=SAVE, save_only_model=False, logging_strategy="no",
            eval_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
            seed=0, ddp_backend="gloo", ddp_bucket_cap_mb=0.01, ddp_find_unused_parameters=False)
        trainer = Trainer(model=model, args=args, train_dataset=samples, optimizers=(opt, None),
                          callbacks=[sync, SaveAtSave()])
        trainer.remove_callback(PrinterCallback)  # (it prints the run's final metrics)
        trainer.train(resume_from_checkpoint=str(out / name / f"checkpoint-{SAVE}") if resume else None)
        return _found(model.losses, model.net, model.seen[SAVE - STEPS], sync.stats())

    _write_job(out, "trainer", rank, resume, _per_algorithm(_job_names(resume), one))


JOBS = {"accelerate": _accelerate_job, "lightning": _lightning_job, "trainer": _trainer_job}


#: each framework's row: the module its fixture imports before forking the ranks, its name in messages
ROWS = {"accelerate": ("accelerate", "Accelerate"), "lightning": ("lightning.pytorch", "Lightning"),
        "trainer": ("transformers.trainer", "HF Trainer")}


@pytest.fixture(scope="module", params=sorted(ROWS))
def framework_runs(request, tmp_path_factory):
    """``(label, full, resumed)``: a framework's two launches (every algorithm each)."""
    job = request.param
    module, label = ROWS[job]
    pytest.importorskip(module.split(".")[0], reason="needs the integrations extra: pip install gradsync[integrations]")
    importlib.import_module(module)  # inherited by the forked ranks
    out = tmp_path_factory.mktemp(job)
    return label, _forked(job, out, False), _forked(job, out, True)


@pytest.mark.parametrize("algorithm", [n for n in NAMES if n not in INTEGRATION_REFUSALS])
def test_framework_resume_continues_the_uninterrupted_losses(framework_runs, algorithm):
    label, full, resumed = framework_runs
    _check_continues((full, resumed), label, algorithm)


@pytest.mark.parametrize("algorithm", sorted(INTEGRATION_REFUSALS))
def test_framework_refuses_clearly(framework_runs, algorithm):
    label, full, _ = framework_runs
    _check_refusal(full, label, algorithm)
