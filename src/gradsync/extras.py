"""Optional dependencies: which extra of ``pip install 'gradsync[EXTRA]'`` provides each library.

The core (``torch``, ``numpy``, ``rich``, ``tqdm``) is all that ``import gradsync``, the algorithms
and the DDP hooks need. Everything else is imported through :func:`require`, so a missing library
fails at once with the command that installs it, not with a bare ``ModuleNotFoundError`` deep in a
run.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from types import ModuleType

#: import name -> (distribution name on PyPI, gradsync extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("matplotlib", "bench"),
    "bayes_opt": ("bayesian-optimization", "tune"),
    "constriction": ("constriction", "oscar"),
    "zstandard": ("zstandard", "oscar"),
    "torchvision": ("torchvision", "vision"),
    "lightning": ("lightning", "integrations"),
    "accelerate": ("accelerate", "integrations"),
    "transformers": ("transformers", "integrations"),
}


def require(module: str, needed_by: str) -> ModuleType:
    """Import ``module`` (a top-level name of :data:`EXTRAS`, or a submodule of one) and return it.

    Args:
        module: import name, e.g. ``"constriction"`` or ``"matplotlib.pyplot"``.
        needed_by: what needs it, for the message (e.g. ``"gradsync.coding"``).

    Raises:
        ImportError: if it is not installed; the message names the package and the
            ``pip install 'gradsync[EXTRA]'`` command that installs it.
        KeyError: if ``module``'s top-level name is not in :data:`EXTRAS` (a programming error).
    """
    package, extra = EXTRAS[module.split(".")[0]]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the library is there but one of its own dependencies is missing
        raise ImportError(f"{needed_by} needs the '{package}' package, which is not installed: "
                          f"pip install 'gradsync[{extra}]'") from exc


def pyplot(figure: str) -> ModuleType | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or ``None`` (with a warning that
    names ``figure`` and the ``bench`` extra) where matplotlib is not installed: reports then write
    their JSON and skip the figure."""
    import logging  # here: this module is imported at every interpreter start-up (install_torchvision_hook)

    try:
        matplotlib = require("matplotlib", figure)
    except ImportError as exc:
        logging.getLogger(__name__).warning("%s skipped: %s", figure, exc)
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


# -- torchvision beside a CPU-only torch ------------------------------------------------------
#: operators torchvision's ``_meta_registrations`` registers fake kernels for without checking that
#: its C++ extension loaded: their schemas must exist for ``import torchvision`` to succeed
TORCHVISION_SCHEMAS = ("nms", "qnms")
_torchvision_library: object | None = None  # kept alive: a collected torch.library.Library undoes its defs
TORCHVISION_PTH = "gradsync-torchvision.pth"


def define_missing_torchvision_ops() -> bool:
    """Make ``import torchvision`` work beside a torch its C++ extension was not built for.

    The torchvision wheel on PyPI (0.28.0 for torch 2.13.0) is built against the CUDA build of torch;
    beside the CPU build its ``_C`` extension cannot load, and ``import torchvision`` then fails with
    ``RuntimeError: operator torchvision::nms does not exist``, whoever imports it (Lightning through
    torchmetrics, Transformers' image utilities, a user). This loads the extension the way torchvision
    does and, only if that fails, defines the schemas of :data:`TORCHVISION_SCHEMAS` (no kernels: the
    detection operators keep raising torchvision's own "Couldn't load custom C++ ops"; the models are
    plain ``torch.nn`` and work). Returns True when it defined them; False where torchvision is not
    installed, its extension loads, or they are defined already. Imports torch."""
    global _torchvision_library
    import importlib.util
    import os

    if _torchvision_library is not None:
        return False
    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin:
        return False
    import torch

    folder = os.path.dirname(spec.origin)
    ext = importlib.machinery.EXTENSION_SUFFIXES
    candidates = [os.path.join(folder, "_C" + s) for s in ext] + [os.path.join(folder, "_C.so")]
    library = next((c for c in candidates if os.path.isfile(c)), None)
    if library is not None:
        try:
            torch.ops.load_library(library)
            return False
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    try:
        for op in TORCHVISION_SCHEMAS:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # defined already (by torchvision's own extension or another definer)
        return False
    _torchvision_library = lib
    return True


class _TorchvisionImport:
    """``sys.meta_path`` finder that runs :func:`define_missing_torchvision_ops` once, just before
    torchvision is first imported, then steps aside (the normal finders import it)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == "torchvision":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                define_missing_torchvision_ops()
            except Exception:  # noqa: BLE001 - never break an import; torchvision's own error follows
                pass
        return None


def install_torchvision_hook() -> None:
    """Run :func:`define_missing_torchvision_ops` at the first ``import torchvision`` of this
    interpreter, whoever imports it (cheap: imports nothing now). Called at interpreter start-up by
    the ``.pth`` file :func:`write_torchvision_pth` puts into the environment (``make setup`` does),
    so ``import lightning.pytorch`` or ``from transformers import Trainer`` work before any gradsync
    import."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionImport())


def write_torchvision_pth(site_packages: str | None = None) -> str:
    """Write :data:`TORCHVISION_PTH` into ``site_packages`` (default: this interpreter's purelib):
    one line that calls :func:`install_torchvision_hook` at start-up, and does nothing if gradsync is
    gone. Returns its path."""
    import os
    import sysconfig

    folder = site_packages or sysconfig.get_paths()["purelib"]
    path = os.path.join(folder, TORCHVISION_PTH)
    line = ("import sys; exec('try:\\n from gradsync.extras import install_torchvision_hook\\n "
            "install_torchvision_hook()\\nexcept Exception:\\n pass')\n")
    with open(path, "w") as f:
        f.write("# gradsync: make torchvision importable beside a CPU-only torch (gradsync.extras)\n" + line)
    return path


if __name__ == "__main__":  # python -m gradsync.extras --write-torchvision-pth (make setup)
    if sys.argv[1:] == ["--write-torchvision-pth"]:
        print(write_torchvision_pth())
    else:
        sys.exit("usage: python -m gradsync.extras --write-torchvision-pth")
