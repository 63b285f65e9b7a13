"""Micro-benchmark: ASC coding time per ring hop, before/after the coder rewrite (issue 11, part 6).

Usage:
    PYTHONPATH=src python benchmarks/asc_coding_time.py [--numel 250000] [--world-size 2] [--levels L]
        [--reps 30] [--width 3.0] [--zero-fraction 0.4] [--json out.json]

One reduce-scatter hop of OSCAR-ASC on one bucket: the sender encodes an ``(numel,)`` integer chunk with
its step model and updates the model, the receiver decodes it with its mirror model and updates that
(what :class:`gradsync.coding.asc.ASCRingCoder`'s ``encode`` / ``decode`` callbacks do on a hop). The
chunk is Laplace-like integers of scale ``--width`` with ``--zero-fraction`` zeros, clamped to
``[-P*L, P*L]`` (the partial sums' range at OSCAR's default ``L = 127 // P``); the models are adapted on
one earlier chunk of the same family first, as in a running training job.

Two implementations are timed, interleaved rep by rep so both see the same machine load:

* ``before``: the coder as of commit 03a31ae (``constriction`` range coder, ``queue.RangeEncoder``;
  int64 copies of the values; histograms over the whole ``2 P L + 1`` alphabet), copied below.
* ``after``: the current :class:`~gradsync.coding.asc.ASCRingCoder` (``stack.AnsCoder`` with one
  ``encode_reverse`` / ``decode`` call per message; int32 symbols end to end; histogram of the symbols
  the coder already holds).

Both make one ``constriction`` call per message (neither has a Python loop per symbol); every rep
checks that the decoded chunk equals the input. Prints medians and minima over reps, in ms per hop
and ns per element, and the coded bytes. Wall-clock timings: run on an otherwise idle machine.
"""

import argparse
import json
import statistics
import time

import constriction
import numpy as np
import torch

from gradsync.algorithms.oscar import default_levels
from gradsync.coding.asc import ASCRingCoder


# -- "before": the coder of commit 03a31ae, kept here as the reference --------------------------------
def _before_encode(values, counts, max_abs, alpha=0.5):
    v = values.detach().cpu().numpy().reshape(-1).astype(np.int64, copy=False)
    lo, hi = int(v.min()), int(v.max())
    header = np.array([lo, hi], dtype=np.int32).view(np.uint8)
    if lo == hi:
        return torch.from_numpy(header.copy())
    probs = counts[lo + max_abs: hi + max_abs + 1] + alpha
    model = constriction.stream.model.Categorical(probs.astype(np.float64), perfect=False)
    enc = constriction.stream.queue.RangeEncoder()
    enc.encode((v - lo).astype(np.int32), model)
    words = enc.get_compressed().astype(np.uint32, copy=False)
    return torch.from_numpy(np.concatenate([header, words.view(np.uint8)]))


def _before_decode(payload, numel, counts, max_abs, alpha=0.5):
    buf = payload.numpy()
    lo, hi = (int(x) for x in buf[:8].copy().view(np.int32))
    if lo == hi:
        return torch.full((numel,), lo, dtype=torch.int64)
    words = buf[8:].copy().view(np.uint32)
    probs = counts[lo + max_abs: hi + max_abs + 1] + alpha
    model = constriction.stream.model.Categorical(probs.astype(np.float64), perfect=False)
    out = constriction.stream.queue.RangeDecoder(words).decode(model, numel).astype(np.int64) + lo
    return torch.from_numpy(out)


def _before_update(row, values, max_abs, decay=0.5):
    v = values.detach().cpu().numpy().reshape(-1).astype(np.int64, copy=False)
    h = np.bincount(v + max_abs, minlength=2 * max_abs + 1).astype(np.float64)
    row *= decay
    row += h


def _chunk(gen, numel, width, zero_fraction, max_abs):
    u = torch.rand(numel, generator=gen) - 0.5
    x = torch.round(-width * torch.sign(u) * torch.log1p(-2 * u.abs())).to(torch.int32)
    x[torch.rand(numel, generator=gen) < zero_fraction] = 0
    return x.clamp_(-max_abs, max_abs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=250_000)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--levels", type=int, default=None, help="default: 127 // world-size (OSCAR's default)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--width", type=float, default=3.0)
    ap.add_argument("--zero-fraction", type=float, default=0.4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the coder itself is single-threaded)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = args.world_size
    levels = args.levels if args.levels is not None else default_levels(p)
    max_abs = p * levels
    gen = torch.Generator().manual_seed(0)
    history = _chunk(gen, args.numel, args.width, args.zero_fraction, max_abs)

    # adapted models: one earlier hop of the same family on both ends
    send_b = np.zeros(2 * max_abs + 1)
    recv_b = np.zeros(2 * max_abs + 1)
    _before_update(send_b, history, max_abs)
    _before_update(recv_b, history, max_abs)
    sender, receiver = ASCRingCoder(p, max_abs), ASCRingCoder(p, max_abs)
    receiver.decode("rs", 0, 0, sender.encode("rs", 0, 0, history), args.numel)

    res = {k: {"encode": [], "decode": [], "bytes": []} for k in ("before", "after")}
    for _ in range(args.reps):
        x = _chunk(gen, args.numel, args.width, args.zero_fraction, max_abs)
        s_b, r_b = send_b.copy(), recv_b.copy()  # time the same model state every rep
        t0 = time.perf_counter()
        pay = _before_encode(x, s_b, max_abs)
        _before_update(s_b, x, max_abs)
        t1 = time.perf_counter()
        y = _before_decode(pay, args.numel, r_b, max_abs)
        _before_update(r_b, y, max_abs)
        t2 = time.perf_counter()
        assert torch.equal(y, x.to(torch.int64)), "before: round trip failed"
        res["before"]["encode"].append(t1 - t0)
        res["before"]["decode"].append(t2 - t1)
        res["before"]["bytes"].append(pay.numel())

        s_a = ASCRingCoder.from_state_dict(sender.state_dict())
        r_a = ASCRingCoder.from_state_dict(receiver.state_dict())
        t0 = time.perf_counter()
        pay = s_a.encode("rs", 0, 0, x)
        t1 = time.perf_counter()
        y = r_a.decode("rs", 0, 0, pay, args.numel)
        t2 = time.perf_counter()
        assert torch.equal(y, x), "after: round trip failed"
        assert np.array_equal(s_a.send_counts, r_a.recv_counts), "after: models diverged"
        res["after"]["encode"].append(t1 - t0)
        res["after"]["decode"].append(t2 - t1)
        res["after"]["bytes"].append(pay.numel())

    out = {"numel": args.numel, "world_size": p, "levels": levels, "max_abs": max_abs, "reps": args.reps,
           "width": args.width, "zero_fraction": args.zero_fraction, "results": {}}
    print(f"one reduce-scatter hop, {args.numel} elements, P={p}, L={levels} (alphabet {2 * max_abs + 1}), "
          f"{args.reps} reps, interleaved")
    print(f"{'coder':8s} {'enc ms':>14s} {'dec ms':>14s} {'enc+dec ms':>14s} {'ns/elem':>8s} {'bytes':>8s} "
          f"{'bits/elem':>9s}")
    for k, r in res.items():
        tot = [a + b for a, b in zip(r["encode"], r["decode"])]
        row = {
            "encode_ms_median": statistics.median(r["encode"]) * 1e3, "encode_ms_min": min(r["encode"]) * 1e3,
            "decode_ms_median": statistics.median(r["decode"]) * 1e3, "decode_ms_min": min(r["decode"]) * 1e3,
            "hop_ms_median": statistics.median(tot) * 1e3, "hop_ms_min": min(tot) * 1e3,
            "ns_per_element_median": statistics.median(tot) * 1e9 / args.numel,
            "bytes_median": statistics.median(r["bytes"]),
        }
        out["results"][k] = row
        print(f"{k:8s} {row['encode_ms_median']:6.2f} ({row['encode_ms_min']:5.2f}) "
              f"{row['decode_ms_median']:6.2f} ({row['decode_ms_min']:5.2f}) "
              f"{row['hop_ms_median']:6.2f} ({row['hop_ms_min']:5.2f}) {row['ns_per_element_median']:8.1f} "
              f"{row['bytes_median']:8.0f} {row['bytes_median'] * 8 / args.numel:9.3f}")
    print("(median (min) over reps; wall-clock, valid only on an otherwise idle machine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
