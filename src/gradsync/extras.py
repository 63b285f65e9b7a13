"""Optional dependencies: which extra of ``pip install 'gradsync[EXTRA]'`` provides each library.

The core (``torch``, ``numpy``, ``rich``, ``tqdm``) is all that ``import gradsync``, the algorithms
and the DDP hooks need. Everything else is imported through :func:`require`, so a missing library
fails at once with the command that installs it, not with a bare ``ModuleNotFoundError`` deep in a
run.
"""

from __future__ import annotations

import importlib
import logging
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
    try:
        matplotlib = require("matplotlib", figure)
    except ImportError as exc:
        logging.getLogger(__name__).warning("%s skipped: %s", figure, exc)
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
