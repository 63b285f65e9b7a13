"""The README's Lightning and Hugging Face quick starts in a fresh interpreter that imports
``lightning.pytorch`` and ``transformers`` before anything of gradsync's.

In the environment ``make setup`` builds, torchvision's wheel is CUDA-built beside the CPU torch;
before the start-up hook (``gradsync-torchvision.pth``, :func:`gradsync.extras.install_torchvision_hook`)
``import lightning.pytorch`` (torchmetrics imports torchvision) and ``from transformers import Trainer``
failed with ``RuntimeError: operator torchvision::nms does not exist`` unless gradsync was imported
first. One ``torchrun --nproc-per-node 2`` job (this file run as a script; nothing of gradsync is
imported at its top) fits a small MLP with ``GradsyncHook("covap", ratio=2)`` for 2 steps and trains
a 1-layer GPT-2 built from a config with ``GradsyncCallback("covap", ratio=2)`` for 2 steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from cli_runner import run_tree

HERE = Path(__file__).resolve()
WORLD, STEPS = 2, 2


def _job(out: Path) -> None:
    import lightning.pytorch as L  # first, before any gradsync import
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    # only the environment's start-up hook (gradsync.extras, no torch) may be there before
    result: dict = {"gradsync_before": sorted(m for m in sys.modules if m.split(".")[0] == "gradsync"),
                    "torchvision_imported": "torchvision.models" in sys.modules}
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from gradsync.integrations.lightning import GradsyncHook
    from gradsync.integrations.transformers import GradsyncCallback

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(WORLD * 4 * STEPS, 16, generator=g), torch.randint(0, 4, (WORLD * 4 * STEPS,), generator=g)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, _):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    hook = GradsyncHook("covap", ratio=2)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=1, callbacks=[hook],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=4))
    result["lightning_iterations"] = hook.stats()["iteration"]

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return WORLD * 2 * STEPS

        def __getitem__(self, i):
            ids = torch.arange(i, i + 8) % 16
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16, n_positions=8, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(output_dir=str(out / "hf"), max_steps=STEPS, per_device_train_batch_size=2,
                             save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True,
                             dataloader_num_workers=0, ddp_backend="gloo")
    callback = GradsyncCallback("covap", ratio=2)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=[callback]).train()
    result["hf_iterations"] = callback.stats()["iteration"]
    (out / f"order_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    # what is checked is written; leave without running destructors: dropping the last reference to the
    # Gloo group can deadlock against its worker thread (torch issue #56297, examples/transformers_covap.py),
    # which hung this job once in a suite run on a loaded machine (300 s timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_lightning_and_transformers_imported_before_gradsync_run_the_quick_starts(tmp_path):
    pytest.importorskip("lightning", reason="needs the integrations extra: pip install gradsync[integrations]")
    pytest.importorskip("transformers", reason="needs the integrations extra: pip install gradsync[integrations]")
    from gradsync.comm.rendezvous import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    src = HERE.parent.parent / "src"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(HERE), str(tmp_path)]
    proc = run_tree(cmd, env=env, cwd=tmp_path, timeout=600)  # a fresh venv compiles Lightning and Transformers on first import
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    for r in range(WORLD):
        res = json.loads((tmp_path / f"order_rank{r}.json").read_text())
        assert set(res["gradsync_before"]) <= {"gradsync", "gradsync.extras"}, res
        assert res["torchvision_imported"], "the frameworks imported torchvision (the failing path)"
        assert res["lightning_iterations"] == STEPS and res["hf_iterations"] == STEPS, res


if __name__ == "__main__":
    _job(Path(sys.argv[1]))
