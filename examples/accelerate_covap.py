"""Accelerate: COVAP on the prepared model, with gradient accumulation, on Fashion-MNIST.

Run (2 CPU processes)::

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_covap.py --synthetic
    torchrun --nproc-per-node 2 examples/accelerate_covap.py --ratio 4 --steps 200

``accelerate launch --cpu --num_processes 2`` starts only ONE process (Accelerate's multi-CPU launch
needs MPI), and ``--multi_gpu --cpu`` is refused. ``--multi_gpu`` on a machine without CUDA starts 2
processes, which synchronise only because the script creates ``Accelerator(cpu=True)`` there (without
it each process trains alone). On 2 GPUs the same ``accelerate launch`` command uses NCCL.
``accelerator.save_state(DIR)`` stores every rank's hook state (``--save DIR``). Needs
``pip install gradsync[integrations]``. Fashion-MNIST: Xiao, Rasul & Vollgraf, arXiv 1708.07747;
COVAP: Meng, Sun & Li, arXiv 2311.04499.
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradsync.integrations.accelerate import HookCheckpoint, register_hook


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
    p.add_argument("--steps", type=int, default=100, help="micro-batches per process")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=32, help="per process and micro-batch")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--synthetic", action="store_true")
    p.add_argument("--save", default=None, help="directory for accelerator.save_state at the end")
    args = p.parse_args()

    # cpu=True without CUDA: otherwise Accelerate runs each launched process as a separate 1-process job
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset(args), batch_size=args.batch_size, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register_hook(model, "covap", ratio=args.ratio)   # None in a single-process run
    if state is not None:
        accelerator.register_for_checkpointing(HookCheckpoint(state, "covap", accelerator.device))

    step = 0
    while step < args.steps:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            step += 1
            if step % 50 == 0:
                accelerator.print(f"micro-batch {step} loss {loss.item():.4f}")
            if step == args.steps:
                break
    if args.save:
        accelerator.save_state(args.save)
    if state is not None:
        s = state.stats()
        print(f"rank {accelerator.process_index}: covap put {s['wire_bytes']:.0f} bytes on the wire, "
              f"dense all-reduce {s['dense_wire_bytes']:.0f} (compression {s['compression_ratio']:.2f}x over "
              f"{s['iteration']} optimizer steps)",
              flush=True)
    # Accelerate keeps the process group; a Gloo group left to interpreter exit can abort the process
    # (SIGABRT, "terminate called without an active exception") after training has finished
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
