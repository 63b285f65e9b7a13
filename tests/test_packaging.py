"""The wheel installs into an existing PyTorch environment with only the core dependencies.

A fresh venv sees the test environment's torch (and torch's own dependencies) through a ``.pth``
file, as a user's environment with torch already installed would; ``pip install gradsync-*.whl``
must then install no other torch and none of the extras; the covap hook must run on a 2-process
Gloo DDP job there; and each optional module must fail with the extra that installs it.
Needs pip's access to PyPI (the core's numpy, rich, tqdm; setuptools for the build), as ``make
test`` has.
"""

import importlib.metadata as md
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXTRA_MODULES = ["matplotlib", "bayes_opt", "constriction", "zstandard", "torchvision", "lightning", "accelerate"]

JOB = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run(rank, world, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        from gradsync.algorithms import build_hook
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        ddp = DDP(model, bucket_cap_mb=0.001)
        state, hook = build_hook("covap", model=model, ratio=2)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(torch.randn(8, 16, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
            opt.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        assert torch.equal(gathered[0], gathered[1]), "replicas differ"
        if rank == 0:
            s = state.stats()
            print(f"COVAP_OK iteration={s['iteration']} compression_ratio={s['compression_ratio']:.4f}")
        # Ends as a user's script does: gradsync's hooks drain their .then callbacks at exit
        # (gradsync.comm.futures), so nothing needs deleting or collecting first.
        dist.destroy_process_group()

    if __name__ == "__main__":
        import gradsync
        print("GRADSYNC_FILE", gradsync.__file__)
        print("TORCH_FILE", torch.__file__)
        check_missing()
        mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
""")

MISSING = textwrap.dedent("""
    def check_missing():
        import importlib
        checks = {
            "gradsync.coding": ("oscar", lambda: importlib.import_module("gradsync.coding")),
            "oscar-asc": ("oscar", lambda: importlib.import_module("gradsync.algorithms").build_hook("oscar-asc")),
            "torchvision": ("vision", lambda: importlib.import_module("gradsync.workloads.vision").torchvision_models()),
            "fusion tuner": ("tune", lambda: importlib.import_module("gradsync.tuning.fusion").FusionTuner()),
            "lightning": ("integrations", lambda: importlib.import_module("gradsync.integrations.lightning").GradsyncHook),
            "transformers": ("integrations",
                             lambda: importlib.import_module("gradsync.integrations.transformers").GradsyncCallback),
        }
        for what, (extra, call) in checks.items():
            try:
                call()
            except ImportError as exc:
                assert f"pip install 'gradsync[{extra}]'" in str(exc), (what, str(exc))
                print("CLEAR", what, "->", extra)
            else:
                raise AssertionError(f"{what} imported without the {extra} extra")
""")


def _closure(name: str, seen: set[str]) -> set[str]:
    """``name`` and every distribution it requires (without extras), as installed here."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return seen
    seen.add(key)
    for req in md.requires(name) or []:
        if "extra ==" in req:
            continue
        dep = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]
        try:
            md.distribution(dep)
        except md.PackageNotFoundError:
            continue  # a platform-conditional requirement not installed here
        _closure(dep, seen)
    return seen


def _expose_existing_torch(target: Path) -> None:
    """Symlink torch and its installed dependencies (packages and dist-info) into ``target``."""
    target.mkdir()
    for name in _closure("torch", set()):
        dist = md.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "bin"}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (target / top).exists():
                (target / top).symlink_to(src)


@pytest.mark.timeout(600)
def test_wheel_installs_beside_existing_torch_with_core_dependencies_only(tmp_path):
    dist_dir = tmp_path / "dist"
    # built with the test environment's setuptools (an isolated build installs one first: 4 s more)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(dist_dir), str(REPO)], check=True, timeout=300)
    wheel = next(dist_dir.glob("gradsync-*.whl"))

    venv = tmp_path / "venv"
    # without pip of its own (ensurepip: 7 s); this pip installs into it (``pip --python``)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    _expose_existing_torch(tmp_path / "existing")
    (site / "existing-torch.pth").write_text(str(tmp_path / "existing") + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--disable-pip-version-check",
                              str(wheel)],
                             env=env, capture_output=True, text=True, timeout=400)
    assert install.returncode == 0, install.stdout + install.stderr
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert "torch" not in installed and not (site / "torch").exists(), "pip installed another torch"
    assert {"gradsync", "numpy", "rich", "tqdm"} <= installed, installed
    for module in EXTRA_MODULES:
        assert not (site / module).exists(), f"{module} (an extra) was installed with the core"

    # one launch of the installed environment's python (each imports torch: 2-3 s): it prints where gradsync
    # and torch come from, checks each optional module's refusal (MISSING), then spawns the 2-rank job (JOB)
    (tmp_path / "job.py").write_text(MISSING + JOB)
    port = 29000 + os.getpid() % 2000
    job = subprocess.run([str(py), str(tmp_path / "job.py"), str(port)], env=env, capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    gradsync_file = re.search(r"^GRADSYNC_FILE (.+)$", job.stdout, re.M).group(1)
    torch_file = re.search(r"^TORCH_FILE (.+)$", job.stdout, re.M).group(1)
    assert gradsync_file.startswith(str(site)), "the test imported gradsync from somewhere else"
    assert torch_file.startswith(str(tmp_path / "existing")), torch_file
    assert job.stdout.count("CLEAR") == 6, job.stdout
    ratio = float(re.search(r"COVAP_OK iteration=6 compression_ratio=([0-9.]+)", job.stdout).group(1))
    assert 1.4 < ratio <= 1.5, job.stdout  # 2 dense start-up iterations, then 4 at K=2: 6/4 of the dense bytes
