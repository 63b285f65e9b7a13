"""The King James Bible as a character-level language-modelling corpus.

The text comes from Debian's ``bible-kjv-text`` package (which pulls in ``bible-kjv``). That package
stores the Bible in a private compressed format (``/usr/lib/bible.data``, plus a concordance file
``bible.data.conc``), so the text is read through the package's own ``bible`` program::

    bible -p /usr/lib -d bible.data -l 79 "gen1:1-rev22:21"

which prints the whole Authorized Version in its default "pretty" layout: a ``Genesis 1`` style
heading before every chapter, each verse indented and preceded by its number, lines broken between
words at 79 columns. That is 4,298,239 characters (73,811 lines) over 73 distinct ASCII characters
(bible-kjv 4.38). ``-l 79`` is passed explicitly because the default width follows ``$COLUMNS``; the
search path ``-p`` is explicit because ``bible`` otherwise looks in the working directory first.
Nothing is downloaded.

``data_dir`` overrides the package: a plain UTF-8 text file, or a directory holding ``kjv.txt``.

The corpus is split contiguously (the last ``val_fraction`` of the characters is validation), and each
split is cut into consecutive windows: input ``x[i] = ids[i*T : i*T + T]`` and target
``y[i] = ids[i*T + 1 : i*T + T + 1]`` (the next character at every position). Input windows do not
overlap and tile the split; the last target character of window ``i`` is the first input character of
window ``i + 1``. Each window is an independent sequence (the model starts from a zero state), so the
first characters of a window are predicted with little context.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

BIBLE_PROGRAM = "bible"
BIBLE_DATA = Path("/usr/lib/bible.data")
WHOLE_TEXT = "gen1:1-rev22:21"
LINE_WIDTH = 79
OVERRIDE_NAME = "kjv.txt"
# Sorted distinct characters of the bible-kjv 4.38 text in the layout above (index = token id).
KJV_VOCAB = "\n !'(),-.0123456789:;?ABCDEFGHIJKLMNOPQRSTUVWYZabcdefghijklmnopqrstuvwxyz"
KJV_CHARS = 4_298_239
INSTALL_HINT = ("Install it with 'apt-get install bible-kjv-text' (Debian/Ubuntu; it pulls in the "
                "'bible' program from bible-kjv), or pass --data-dir with a plain UTF-8 text file "
                f"(or a directory holding {OVERRIDE_NAME}).")


class DatasetMissing(FileNotFoundError):
    """The KJV text could not be found; the message says how to get it."""


class DatasetCorrupt(ValueError):
    """The text is not usable (not UTF-8, cut off inside a character, too short); the message names the file."""


def _read_override(data_dir: str | os.PathLike) -> str:
    p = Path(data_dir)
    if p.is_dir():
        p = p / OVERRIDE_NAME
    if not p.is_file():
        raise DatasetMissing(f"KJV text file {p} not found. {INSTALL_HINT}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetCorrupt(f"{p}: not UTF-8 text at byte {exc.start:,} of {len(exc.object):,} ({exc.reason}; "
                             "a truncated or damaged file?)") from None


def read_text(data_dir: str | os.PathLike | None = None) -> str:
    """The whole corpus as one string.

    Args:
        data_dir: None to print the text with the ``bible`` program from ``bible-kjv-text``; else a
            UTF-8 text file, or a directory holding ``kjv.txt``, used instead.

    Returns:
        The text (4,298,239 characters for bible-kjv 4.38).

    Raises:
        DatasetMissing: if the override file, the ``bible`` program or its data file is absent.
        DatasetCorrupt: naming the override file, if it is not UTF-8 (e.g. cut inside a character).
        RuntimeError: if ``bible`` fails or prints nothing.
    """
    if data_dir:
        return _read_override(data_dir)
    program = shutil.which(BIBLE_PROGRAM)
    if program is None or not BIBLE_DATA.is_file():
        missing = f"program {BIBLE_PROGRAM!r}" if program is None else f"data file {BIBLE_DATA}"
        raise DatasetMissing(f"King James Bible text not found ({missing} missing). {INSTALL_HINT}")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    cmd = [program, "-p", str(BIBLE_DATA.parent), "-d", BIBLE_DATA.name, "-l", str(LINE_WIDTH), WHOLE_TEXT]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, env=env, cwd="/",
                          timeout=60, check=False)
    if proc.returncode != 0 or not proc.stdout:
        err = proc.stderr.decode("utf-8", "replace").strip()
        raise RuntimeError(f"{' '.join(cmd)!r} failed (exit {proc.returncode}): {err or 'no output'}")
    return proc.stdout.decode("utf-8")


def build_vocab(text: str) -> str:
    """Sorted distinct characters of ``text``; character ``vocab[i]`` has token id ``i``.

    Deterministic: depends only on the set of characters (73 for the KJV, equal to ``KJV_VOCAB``).
    """
    return "".join(sorted(set(text)))


def encode(text: str, vocab: str) -> torch.Tensor:
    """Token ids int64 ``[len(text)]`` of ``text`` under ``vocab``.

    Raises:
        ValueError: if ``text`` has a character outside ``vocab``.
    """
    if not text:
        return torch.zeros(0, dtype=torch.int64)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
    if np.any(table[1:] <= table[:-1]):
        raise ValueError("vocab must be sorted distinct characters (see build_vocab)")
    ids = np.searchsorted(table, codes)
    ids_c = np.minimum(ids, len(table) - 1)
    bad = table[ids_c] != codes
    if bad.any():
        ch = chr(int(codes[np.argmax(bad)]))
        raise ValueError(f"character {ch!r} is not in the vocabulary")
    return torch.from_numpy(ids.astype(np.int64))


def decode(ids: torch.Tensor, vocab: str) -> str:
    """Inverse of :func:`encode` for any int tensor of token ids (flattened)."""
    return "".join(vocab[i] for i in ids.reshape(-1).tolist())


def split_ids(ids: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous split: ``(ids[:s], ids[s:])`` with ``s = len - round(val_fraction * len)``.

    Raises:
        ValueError: if ``val_fraction`` is not in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
    s = ids.numel() - round(val_fraction * ids.numel())
    return ids[:s], ids[s:]


def make_windows(ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a 1-D id sequence into ``N = (len(ids) - 1) // seq_len`` next-character examples.

    Returns:
        ``(x, y)`` int64 ``[N, seq_len]`` each, ``x[i] = ids[i*T : (i+1)*T]`` and
        ``y[i] = ids[i*T + 1 : (i+1)*T + 1]``. Trailing characters that do not fill a window are dropped.

    Raises:
        ValueError: if ``seq_len < 1`` or the sequence is shorter than one window.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len}")
    n = (ids.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"{ids.numel()} characters are too few for one window of {seq_len} + 1")
    used = ids[: n * seq_len + 1]
    x = used[:-1].reshape(n, seq_len).clone()
    y = used[1:].reshape(n, seq_len).clone()
    return x, y


def load(data_dir: str | os.PathLike | None = None, seq_len: int = 128, val_fraction: float = 0.05):
    """The corpus as training and validation windows.

    Args:
        data_dir: see :func:`read_text`.
        seq_len: window length T (characters per example).
        val_fraction: share of the text, taken from its end, kept for validation.

    Returns:
        ``(train_x, train_y, val_x, val_y, vocab)``: int64 tensors ``[N, T]`` of token ids (targets are
        the inputs shifted by one character) and the vocabulary string (``vocab[id]`` is the
        character). For the KJV with T=128 and 5% validation: N = 31,900 train and 1,678 validation
        windows, 73 tokens.

    Raises:
        DatasetMissing: if the text is absent.
        DatasetCorrupt: naming the file, if it is not UTF-8 or too short for one window per split.
    """
    text = read_text(data_dir)
    vocab = build_vocab(text)
    ids = encode(text, vocab)
    train_ids, val_ids = split_ids(ids, val_fraction)
    try:
        train_x, train_y = make_windows(train_ids, seq_len)
        val_x, val_y = make_windows(val_ids, seq_len)
    except ValueError as exc:
        source = data_dir if data_dir else f"the text of {BIBLE_PROGRAM!r} ({BIBLE_DATA})"
        raise DatasetCorrupt(f"{source}: {len(text):,} characters, too short for training and validation "
                             f"windows of {seq_len} ({exc}); a truncated file?") from None
    return train_x, train_y, val_x, val_y, vocab
