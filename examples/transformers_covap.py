"""Hugging Face Trainer: COVAP on a small character-level GPT-2 trained on the King James Bible.

Run (2 CPU processes; the same command on a GPU machine uses NCCL)::

    torchrun --nproc-per-node 2 examples/transformers_covap.py --ratio 4 --steps 200
    torchrun --nproc-per-node 2 examples/transformers_covap.py --ratio 4 --steps 400 --resume

The model is built from a ``GPT2Config`` (no hub download) with the 73 characters of the text as its
vocabulary. ``GradsyncCallback`` registers the hook on the DDP model the Trainer wraps and stores every
rank's hook state in each ``checkpoint-N/`` (``--save-steps``); ``--resume`` continues from the last
checkpoint in ``--out`` with the hook state restored. Needs ``pip install 'gradsync[integrations]'``
and the KJV text (``apt-get install bible-kjv-text``, or ``--data-dir`` with a UTF-8 text file).
GPT-2: Radford et al. 2019; COVAP: Meng, Sun & Li, arXiv 2311.04499.
"""

import argparse
import os
import time

import torch

from gradsync.integrations.transformers import GradsyncCallback  # first: makes torchvision importable
from gradsync.workloads import kjv
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Windows(torch.utils.data.Dataset):
    """Next-character examples: ``input_ids`` and ``labels`` int64 ``[T]`` (GPT-2 shifts the labels)."""

    def __init__(self, data_dir, seq_len):
        text = kjv.read_text(data_dir)
        self.vocab = kjv.build_vocab(text)
        self.x = kjv.make_windows(kjv.encode(text, self.vocab), seq_len)[0]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def ratio(value: str):
    return value if value == "auto" else int(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=ratio, default=4, help="COVAP's K (1..32) or 'auto'")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per process")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--out", default="gpt2-kjv", help="Trainer output_dir (checkpoints)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    p.add_argument("--data-dir", default=None, help="UTF-8 text to train on instead of the KJV")
    args = p.parse_args()

    data = Windows(args.data_dir, args.seq_len)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=4, n_positions=args.seq_len,
                                       vocab_size=len(data.vocab), bos_token_id=0, eos_token_id=0))
    sync = GradsyncCallback("covap", ratio=args.ratio)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3, logging_steps=50, save_steps=args.save_steps, report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[sync])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    s = sync.stats()
    if s:
        print(f"rank {os.environ.get('RANK', 0)}: covap put {s['wire_bytes']:.0f} bytes on the wire, "
              f"dense all-reduce {s['dense_wire_bytes']:.0f} (compression {s['compression_ratio']:.2f}x over "
              f"{s['iteration']} steps)")
    # The Trainer keeps its process group; shut it down before exit (a Gloo group left to interpreter
    # teardown can abort the process). Gloo's worker thread frees a finished collective's work after the
    # caller has seen it complete, and freeing the Trainer's last all_gather (Python tensors) needs the GIL.
    # Dropping the last reference to the group (DDP's reducer, when main() returns) joins that worker while
    # holding the GIL: a deadlock (torch issue #56297; seen here as ~ProcessGroupGloo joining a worker
    # blocked in ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref). The barrier drains the queue and the
    # sleep releases the GIL so the worker can free those works before anything is destroyed.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        time.sleep(1.0)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
