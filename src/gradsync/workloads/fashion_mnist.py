"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017) read from the standard idx files.

The idx files are the ones Debian's ``dataset-fashion-mnist`` package installs under
``/usr/share/datasets/fashion-mnist``; ``--data-dir`` points anywhere else. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# Per-pixel mean and standard deviation of the 60,000 training images (scaled to [0, 1]).
MEAN, STD = 0.2860, 0.3530
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


class DatasetMissing(FileNotFoundError):
    """The idx files were not found; the message says how to get them."""


def _find(data_dir: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        p = data_dir / name
        if p.is_file():
            return p
    raise DatasetMissing(
        f"Fashion-MNIST file {stem}[.gz] not found in {data_dir}. Install it with "
        "'apt-get install dataset-fashion-mnist' (Debian/Ubuntu; files land in "
        f"{DEFAULT_DIR}) or download the four idx files from "
        "github.com/zalandoresearch/fashion-mnist and pass --data-dir DIR."
    )


class DatasetCorrupt(ValueError):
    """A dataset file is truncated or not what its name says; the message names the file and what is wrong."""


def read_idx(path: Path) -> np.ndarray:
    """Read one idx file (optionally gzip-compressed) into a read-only uint8 array. The array is kept
    per process for the file's path, size and modification time: the training images take 0.3 s to
    decompress, and ``gradsync train`` checks the data before it forks the ranks, which then share it.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        DatasetCorrupt: naming ``path``, if it is not a complete unsigned-byte idx file (a truncated
            or damaged ``.gz``, a wrong magic number, fewer bytes than its header's shape needs).
    """
    st = os.stat(path)
    return _read_idx(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_idx(name: str, size: int, mtime_ns: int) -> np.ndarray:
    path = Path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, OSError, zlib.error) as exc:  # gzip: EOFError when cut short, BadGzipFile, zlib.error
        raise DatasetCorrupt(f"{path}: truncated or damaged gzip file ({exc}); replace it (apt-get install "
                             "--reinstall dataset-fashion-mnist, or a fresh download)") from None
    magic = int.from_bytes(data[0:4], "big")
    if len(data) < 4 or magic >> 8 != 0x08:
        raise DatasetCorrupt(f"{path}: not an unsigned-byte idx file (magic {magic:#x})")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    need = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != need:
        raise DatasetCorrupt(f"{path}: {len(data):,} bytes, but its header (shape {shape}) needs {need:,}; "
                             "the file is truncated or damaged")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def load(data_dir: str | os.PathLike | None = None, split: str = "train"):
    """Load one split as tensors.

    Returns:
        ``(images, labels)``: images float32 ``[N, 1, 28, 28]`` normalised with the training mean and
        std; labels int64 ``[N]`` in 0..9. N = 60,000 for ``train`` and 10,000 for ``test``.

    Raises:
        DatasetMissing: if the files are not in ``data_dir``.
        DatasetCorrupt: naming the file, if one is truncated or damaged (see :func:`read_idx`).
        ValueError: if ``split`` is not ``train`` or ``test``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be one of train, test; got {split!r}")
    d = Path(data_dir) if data_dir else DEFAULT_DIR
    images = read_idx(_find(d, FILES[f"{split}_images"]))
    labels = read_idx(_find(d, FILES[f"{split}_labels"]))
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{d}: {split} images and labels differ in count")
    x = torch.from_numpy(images.copy()).float().div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y
