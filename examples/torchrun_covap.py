"""Plain PyTorch + torchrun: COVAP as a DDP communication hook on Fashion-MNIST.

Run (2 CPU processes; on a machine with 2 GPUs the same command uses NCCL)::

    torchrun --nproc-per-node 2 examples/torchrun_covap.py --ratio 4 --steps 200
    torchrun --nproc-per-node 2 examples/torchrun_covap.py --synthetic --steps 20   # no dataset needed

Fashion-MNIST (Xiao, Rasul & Vollgraf 2017, arXiv 1708.07747) is read from the idx files of Debian's
``dataset-fashion-mnist`` package (``--data-dir`` for another place). COVAP: Meng, Sun & Li,
"Near-Linear Scaling Data Parallel Training with Overlapping-Aware Gradient Compression",
arXiv 2311.04499 (2023). Each rank prints its hook statistics at the end (bytes sent vs dense bytes).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gradsync.algorithms import build_hook


def dataset(args) -> TensorDataset:
    """Fashion-MNIST training images ``[N, 1, 28, 28]`` float32 and labels ``[N]`` int64, or 4,096
    synthetic images with labels from a fixed random linear rule (``--synthetic``)."""
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 1, 28, 28, generator=g)
        return TensorDataset(x, (x.flatten(1) @ torch.randn(784, 10, generator=g)).argmax(1))
    from gradsync.workloads import fashion_mnist

    return TensorDataset(*fashion_mnist.load(args.data_dir, "train"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="covap")
    p.add_argument("--ratio", type=int, default=4, help="COVAP's K (1..32)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--synthetic", action="store_true")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    options = {"ratio": args.ratio} if args.algorithm == "covap" else {}
    state, hook = build_hook(args.algorithm, model=model, **options)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    data = dataset(args)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 50 == 0 and dist.get_rank() == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1
    s = state.stats()
    print(f"rank {dist.get_rank()}: {args.algorithm} put {s['wire_bytes']:.0f} bytes on the wire, "
          f"dense all-reduce {s['dense_wire_bytes']:.0f} "
          f"(compression {s['compression_ratio']:.2f}x over {s['iteration']} iterations)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
