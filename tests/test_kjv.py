"""The KJV character corpus (Debian ``bible-kjv-text``) and the character-level LSTM."""

import math
import shutil

import pytest
import torch

from gradsync.workloads import kjv
from gradsync.workloads.charlstm import CharLSTM, bits_per_char, sequence_loss

HAVE_KJV = shutil.which(kjv.BIBLE_PROGRAM) is not None and kjv.BIBLE_DATA.is_file()
needs_kjv = pytest.mark.skipif(not HAVE_KJV, reason="KJV text not installed (apt-get install bible-kjv-text)")
T = 128


@pytest.fixture(scope="module")
def text():
    return kjv.read_text()


@pytest.fixture(scope="module")
def data():
    return kjv.load(seq_len=T)


@needs_kjv
def test_text_size_and_vocabulary(text):
    assert 4_200_000 < len(text) < 4_400_000
    assert text.startswith("\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.")
    assert text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    vocab = kjv.build_vocab(text)
    assert 70 <= len(vocab) <= 76
    assert list(vocab) == sorted(set(vocab))
    assert vocab == kjv.build_vocab(text[::-1]) == kjv.build_vocab(kjv.read_text())
    if len(text) == kjv.KJV_CHARS:  # bible-kjv 4.38
        assert vocab == kjv.KJV_VOCAB


@needs_kjv
def test_windows_shapes_shift_and_split(text, data):
    train_x, train_y, val_x, val_y, vocab = data
    for t in (train_x, train_y, val_x, val_y):
        assert t.dtype == torch.int64 and t.dim() == 2 and t.shape[1] == T
        assert int(t.min()) >= 0 and int(t.max()) < len(vocab)
    assert train_x.shape == train_y.shape and val_x.shape == val_y.shape
    n = len(text)
    assert train_x.shape[0] == (n - round(0.05 * n) - 1) // T
    assert val_x.shape[0] == (round(0.05 * n) - 1) // T
    # y is x shifted by one character, within and across consecutive windows.
    assert torch.equal(train_x[:, 1:], train_y[:, :-1])
    assert torch.equal(train_y[:-1, -1], train_x[1:, 0])
    assert torch.equal(val_x[:, 1:], val_y[:, :-1])
    # Training windows tile the start of the text; validation windows tile the last 5%, after it.
    ids = kjv.encode(text, vocab)
    split = n - round(0.05 * n)
    assert torch.equal(train_x.reshape(-1), ids[: train_x.numel()])
    assert train_y.numel() + 1 <= split  # the last training target lies before the split
    assert torch.equal(val_x.reshape(-1), ids[split: split + val_x.numel()])
    assert torch.equal(val_y.reshape(-1), ids[split + 1: split + 1 + val_y.numel()])
    assert kjv.decode(train_x[0, :14], vocab) == "\nGenesis 1\n\n  "


def test_encode_decode_and_windows_on_small_text():
    text = "abcab\nca"
    vocab = kjv.build_vocab(text)
    assert vocab == "\nabc"
    ids = kjv.encode(text, vocab)
    assert ids.tolist() == [1, 2, 3, 1, 2, 0, 3, 1]
    assert kjv.decode(ids, vocab) == text
    x, y = kjv.make_windows(ids, 3)
    assert x.tolist() == [[1, 2, 3], [1, 2, 0]] and y.tolist() == [[2, 3, 1], [2, 0, 3]]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        kjv.encode("abz", vocab)
    with pytest.raises(ValueError):
        kjv.make_windows(ids, 8)


def test_override_text_file(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("In the beginning God created the heaven and the earth.\n" * 40, encoding="utf-8")
    train_x, _, val_x, _, vocab = kjv.load(f, seq_len=16)
    assert vocab == kjv.build_vocab(f.read_text())
    assert train_x.shape[1] == 16 and val_x.shape[0] >= 1
    (tmp_path / "kjv.txt").write_text(f.read_text(), encoding="utf-8")
    assert kjv.read_text(tmp_path) == f.read_text()


def test_truncated_text_file_names_the_file(tmp_path):
    f = tmp_path / "kjv.txt"
    f.write_bytes("In the beginning \u00e9".encode("utf-8")[:-1])  # cut inside a two-byte character
    with pytest.raises(kjv.DatasetCorrupt, match=f"{f}: not UTF-8 text at byte 17 of 18"):
        kjv.load(f, seq_len=4)
    f.write_text("In the beginning", encoding="utf-8")
    with pytest.raises(kjv.DatasetCorrupt, match=f"{f}: 16 characters, too short .* windows of 128"):
        kjv.load(f)
    assert isinstance(kjv.DatasetCorrupt("x"), ValueError)


def test_missing_data_error(tmp_path, monkeypatch):
    with pytest.raises(kjv.DatasetMissing, match="apt-get install bible-kjv-text") as e:
        kjv.read_text(tmp_path / "nope.txt")
    assert isinstance(e.value, FileNotFoundError)
    monkeypatch.setattr(kjv, "BIBLE_PROGRAM", "gradsync-no-such-bible-program")
    with pytest.raises(kjv.DatasetMissing, match="apt-get install bible-kjv-text"):
        kjv.load()
    monkeypatch.undo()
    monkeypatch.setattr(kjv, "BIBLE_DATA", tmp_path / "bible.data")
    with pytest.raises(FileNotFoundError, match="apt-get install bible-kjv-text"):
        kjv.read_text()


def test_model_shapes_and_units(one_thread):
    torch.manual_seed(0)
    m = CharLSTM(73)
    assert 850_000 < sum(p.numel() for p in m.parameters()) < 900_000
    x = torch.randint(0, 73, (4, 10))
    out = m(x)
    assert out.shape == (4, 10, 73) and out.dtype == torch.float32
    loss = sequence_loss(out, x)
    assert loss.dim() == 0
    # An untrained model is close to uniform: about log2(73) = 6.19 bits per character.
    assert abs(bits_per_char(loss.item()) - math.log2(73)) < 0.2
    assert math.isclose(bits_per_char(math.log(2.0)), 1.0)
    assert torch.isclose(sequence_loss(out, x, "sum"), loss * x.numel())
    # channels_first gives the [B, V, T] layout F.cross_entropy takes directly, same values.
    m.channels_first = True
    out_cf = m(x)
    assert out_cf.shape == (4, 73, 10) and torch.equal(out_cf, out.transpose(1, 2))
    assert torch.isclose(torch.nn.functional.cross_entropy(out_cf, x), loss)


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and much faster when other processes share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _few_steps(x, y, vocab_size, steps=30):
    torch.manual_seed(0)
    m = CharLSTM(vocab_size, embed=16, hidden=64, layers=2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = sequence_loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@needs_kjv
def test_training_reduces_loss_on_kjv_slice(data, one_thread):
    train_x, train_y, _, _, vocab = data
    losses = _few_steps(train_x[:8, :64], train_y[:8, :64], len(vocab))
    assert losses[-1] < losses[0] - 1.0, losses


def test_training_reduces_loss_without_package(one_thread):
    text = "And God said, Let there be light: and there was light.\n" * 10
    vocab = kjv.build_vocab(text)
    x, y = kjv.make_windows(kjv.encode(text, vocab), 32)
    losses = _few_steps(x[:8], y[:8], len(vocab))
    assert losses[-1] < losses[0] - 1.0, losses
