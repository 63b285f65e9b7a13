"""Benchmark: ASC vs raw ints / static table / zlib / zstd, and balanced vs equal chunks.

Usage: python benchmarks/asc_coding.py [P] [L] [ITERS]

Measure ASC vs raw ints / static table / zlib / zstd, and balanced vs equal chunks, on real
Fashion-MNIST gradients of a small CNN (2 conv + 2 fc), P simulated ranks in one process."""
import sys, time, json
import numpy as np, torch, torch.nn as nn
from gradsync.coding.asc import measure_ring_coding, ASCRingCoder
from gradsync.comm.ring import balanced_bounds, equal_bounds
from gradsync.algorithms.oscar import stochastic_round
from gradsync.workloads import fashion_mnist

torch.set_num_threads(1)
P = int(sys.argv[1]) if len(sys.argv) > 1 else 4
L = int(sys.argv[2]) if len(sys.argv) > 2 else 31
ITERS = int(sys.argv[3]) if len(sys.argv) > 3 else 12
X, Y = fashion_mnist.load(None, "train")
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1),
                      nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 49, 128), nn.ReLU(), nn.Linear(128, 10))
params = list(model.parameters())
n = sum(p.numel() for p in params)
opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
gen = [torch.Generator().manual_seed(100 + r) for r in range(P)]
err = [torch.zeros(n) for _ in range(P)]
iters, prev = [], None
for it in range(ITERS):
    grads = []
    for r in range(P):
        idx = torch.randint(0, 60000, (64,), generator=gen[r])
        model.zero_grad()
        nn.functional.cross_entropy(model(X[idx]), Y[idx]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
    xs = [g + e for g, e in zip(grads, err)]
    scale = max(float(x.abs().max()) for x in xs)
    qs = [stochastic_round(x / scale * L, gen[r]).clamp(-L, L) for r, x in enumerate(xs)]
    err = [x - q.float() * scale / L for x, q in zip(xs, qs)]
    iters.append(qs)
    agg = torch.stack(qs).sum(0)
    mean = agg.float() * scale / L / P
    off = 0
    for p in params:
        p.grad = mean[off:off + p.numel()].view_as(p).clone(); off += p.numel()
    opt.step()
zero_frac = [float((torch.stack(q).sum(0) == 0).float().mean()) for q in iters]
K = P * L
# bounds: equal, and balanced from the previous aggregate under the shared all-gather model
eq = [equal_bounds(n, P)] * ITERS
bal = [equal_bounds(n, P)]
coder = ASCRingCoder(P, K)
for it in range(1, ITERS):
    prev_agg = torch.stack(iters[it - 1]).sum(0)
    coder.end_iteration(prev_agg)
    counts = torch.from_numpy(coder.ag_counts)
    probs = (counts + 0.5) / (counts.sum() + 0.5 * counts.numel())
    bits = -torch.log2(probs)[prev_agg.long() + K]
    bal.append(balanced_bounds(bits, P))
t = time.perf_counter()
import os
DEC = float(os.environ.get("DECAY", "0"))
m_eq = measure_ring_coding(iters, eq, K, decay=DEC)
m_bal = measure_ring_coding(iters, bal, K, decay=DEC)
out = {"P": P, "levels": L, "iters": ITERS, "numel": n, "zero_frac_mean": float(np.mean(zero_frac)),
       "equal": m_eq, "balanced": m_bal, "seconds": time.perf_counter() - t}
print(json.dumps(out, indent=1))
