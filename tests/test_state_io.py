"""One form of every algorithm's state: ``state_dict()`` reads back with ``torch.load(weights_only=True)``
(torch's default) for every registered algorithm, through every entry point's path (a plain
``torch.save``, the integrations' gathered payload), and a loaded state's tensors follow the
module's device (checkpoints are read with ``map_location="cpu"``)."""

import io

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from every_algorithm import batches, build_small

from gradsync.algorithms import REGISTRY
from gradsync.algorithms.state_io import from_safe, map_tree, to_safe

HOOKS = sorted(n for n, s in REGISTRY.items() if s.make_hook is not None)
STEPS = 4
CPU_ONLY = ("oscar-sw", "oscar-asc", "countsketch")  # refuse non-CPU buckets by design (test_cuda_nccl.py)


def _tensors(obj, skip=("rng_state", "__gradsync_randomstate__")):
    """Every tensor in ``obj`` (a state_dict), with its path; ``skip``: keys of generator states
    (CPU tensors by design: torch's, and numpy's in the safe form)."""
    out = []

    def leaf(x, path):
        if isinstance(x, torch.Tensor) and not any(f".{k}" in path for k in skip):
            out.append((path, x))
        return x

    map_tree(obj, leaf)
    return out


def _weights_only_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _every_hook(rank, world, names):
    from gradsync.integrations import gather_hook_state, load_hook_state

    out = {}
    data = batches(rank, 2 + STEPS)
    for name in names:
        res = out[name] = {}
        try:
            dp = build_small(name)
            dp.warm_up(data[:2], F.cross_entropy)
            for x, y in data[2:]:
                dp.train_step(x, y, F.cross_entropy)
            # torch.save(state.state_dict()) and torch's default load, as the README's quick start does
            saved = _weights_only_round_trip(dp.state.state_dict())
            fresh = build_small(name)
            fresh.state.load_state_dict(saved)
            mine, theirs = _tensors(dp.state.state_dict()), _tensors(fresh.state.state_dict())
            res["reloaded_equal"] = [p for p, _ in mine] == [p for p, _ in theirs] and all(
                torch.equal(a, b) for (_, a), (_, b) in zip(mine, theirs))
            # the integrations' payload (Lightning, Accelerate, HF): gathered on rank 0, written, read back
            payload = gather_hook_state(name, dp.state)
            back = [None]
            if rank == 0:
                back = [_weights_only_round_trip(payload)]
            dist.broadcast_object_list(back, src=0)
            load_hook_state(name, fresh.state, back[0], device=torch.device("cpu"))
            res["payload"] = "ok"
            # the synchroniser's load (gradsync train, gradsync.wrap's state): tensors follow the module
            if name not in CPU_ONLY:
                dp.module.to("meta")
                dp.load_state_dict(saved)
            res["devices"] = sorted({str(t.device) for _, t in _tensors(dp.state.state_dict())})
            fresh.close()
            dp.close()
        except Exception as exc:  # noqa: BLE001 - reported per algorithm
            res["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        dist.barrier()
    return out


def test_every_hook_state_loads_weights_only_through_every_path_and_follows_the_module_device():
    """Failed before the one safe form: ``powersgd`` (torch's ``PowerSGDState`` holds a numpy
    ``RandomState``) and ``oscar-asc`` (numpy coder counts) raised UnpicklingError on the
    weights-only load; and before the synchroniser moved the loaded state, every state on a module
    moved to another device (``meta`` here; CUDA in ``test_cuda_nccl.py``) kept its CPU tensors."""
    results = run_ranks(_every_hook, 2, HOOKS, timeout=300, pg_timeout=60)
    for rank, res in enumerate(results):
        errors = {n: r["error"] for n, r in res.items() if "error" in r}
        assert not errors, f"rank {rank}: {errors}"
        assert all(r["reloaded_equal"] for r in res.values()), res
        moved = {n: r["devices"] for n, r in res.items() if n not in CPU_ONLY and r["devices"] not in ([], ["meta"])}
        assert not moved, f"rank {rank}: loaded state not on the module's device: {moved}"
        assert {n for n, r in res.items() if r["devices"] == ["meta"]} >= {"powersgd", "powersgd-overlap", "covap"}


def test_safe_form_round_trips_numpy_and_is_idempotent():
    rs = np.random.RandomState(3)
    rs.rand(5)
    obj = {"a": np.arange(4, dtype=np.int16), "s": np.float32(2.5), "rs": rs, "t": (torch.ones(2), [1, "x"])}
    safe = to_safe(obj)
    assert to_safe(safe).keys() == safe.keys()
    back = from_safe(_weights_only_round_trip(to_safe(safe)))
    assert back["a"].dtype == np.int16 and np.array_equal(back["a"], obj["a"])
    assert back["s"] == np.float32(2.5) and back["rs"].rand() == rs.rand()
    assert torch.equal(back["t"][0], torch.ones(2)) and back["t"][1] == [1, "x"]
