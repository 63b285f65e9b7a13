"""Lightning: COVAP through :class:`gradsync.integrations.lightning.GradsyncHook` on Fashion-MNIST.

Run (2 CPU processes; Lightning starts the second one itself)::

    python examples/lightning_covap.py --ratio 4 --epochs 1
    python examples/lightning_covap.py --synthetic --epochs 1            # no dataset needed
    torchrun --nproc-per-node 2 examples/lightning_covap.py --synthetic  # or let torchrun start both
    python examples/lightning_covap.py --accelerator gpu --devices 2    # 2 GPUs, NCCL

The checkpoint Lightning writes after each epoch (``--out``) carries every rank's hook state; resume with
``--resume PATH``. Needs ``pip install gradsync[integrations]``. Fashion-MNIST: Xiao, Rasul & Vollgraf,
arXiv 1708.07747; COVAP: Meng, Sun & Li, arXiv 2311.04499.
"""

import argparse

from gradsync.integrations.lightning import GradsyncHook  # first: makes torchvision importable

import lightning.pytorch as L  # noqa: I001
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch, _):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(args) -> TensorDataset:
    """Fashion-MNIST training set (images ``[N, 1, 28, 28]`` float32, labels ``[N]`` int64) or 4,096
    synthetic images labelled by a fixed random linear rule."""
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 1, 28, 28, generator=g)
        return TensorDataset(x, (x.flatten(1) @ torch.randn(784, 10, generator=g)).argmax(1))
    from gradsync.workloads import fashion_mnist

    return TensorDataset(*fashion_mnist.load(args.data_dir, "train"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=int, default=4, help="COVAP's K (1..32)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: epochs only)")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--out", default="runs/lightning_covap")
    p.add_argument("--resume", default=None, help="checkpoint to resume from")
    args = p.parse_args()

    L.seed_everything(0)
    hook = GradsyncHook("covap", ratio=args.ratio)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy="ddp",
                        max_epochs=args.epochs, max_steps=args.max_steps, logger=False,
                        callbacks=[hook, ModelCheckpoint(dirpath=args.out, save_last=True)])
    loader = DataLoader(dataset(args), batch_size=args.batch_size, shuffle=True)
    trainer.fit(Classifier(), loader, ckpt_path=args.resume)
    s = hook.stats()
    print(f"rank {trainer.global_rank}: covap put {s['wire_bytes']:.0f} bytes on the wire, "
          f"dense all-reduce {s['dense_wire_bytes']:.0f} "
          f"(compression {s['compression_ratio']:.2f}x over {s['iteration']} iterations)", flush=True)
    if torch.distributed.is_initialized():  # Lightning keeps the group; shut it down before exit
        torch.distributed.barrier()  # Gloo's workers free the last collectives first (transformers_covap.py)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
