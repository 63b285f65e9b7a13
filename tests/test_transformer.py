"""The decoder-only character transformer and the kjv-transformer workload."""

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from gradsync.workloads import TRANSFORMER_CONTEXT, TRANSFORMER_TRAIN_WINDOWS, get_workload, kjv
from gradsync.workloads.transformer import CharTransformer, causal_mask

HAVE_KJV = shutil.which(kjv.BIBLE_PROGRAM) is not None and kjv.BIBLE_DATA.is_file()
needs_kjv = pytest.mark.skipif(not HAVE_KJV, reason="KJV text not installed (apt-get install bible-kjv-text)")


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _small(**kw):
    torch.manual_seed(0)
    args = {"vocab_size": 11, "context": 16, "d_model": 32, "heads": 4, "layers": 2}
    args.update(kw)
    return CharTransformer(**args)


def test_causal_mask():
    m = causal_mask(4)
    assert m.shape == (4, 4) and m.dtype == torch.float32
    assert torch.equal(m, torch.nn.Transformer.generate_square_subsequent_mask(4))
    assert torch.isinf(m[0, 1]) and m[1, 0] == 0 and m[3, 3] == 0
    with pytest.raises(ValueError, match="length"):
        causal_mask(0)


def test_shapes_and_initial_loss(one_thread):
    m = _small()
    x = torch.randint(0, 11, (3, 16))
    out = m(x)
    assert out.shape == (3, 16, 11) and out.dtype == torch.float32
    # Untrained: close to a uniform guess over 11 characters, log2(11) = 3.46 bits per character.
    bpc = F.cross_entropy(out.reshape(-1, 11), x.reshape(-1)).item() / math.log(2)
    assert abs(bpc - math.log2(11)) < 0.5
    assert m(x[:, :5]).shape == (3, 5, 11)  # shorter than the context
    m.channels_first = True
    out_cf = m(x)
    assert out_cf.shape == (3, 11, 16) and torch.allclose(out_cf, out.transpose(1, 2), atol=1e-6)
    out_cf.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("training", [True, False])
def test_causal_future_tokens_do_not_change_earlier_logits(one_thread, training):
    m = _small()
    m.train(training)
    x = torch.randint(0, 11, (2, 16))
    k = 9
    x2 = x.clone()
    x2[:, k] = (x[:, k] + 1) % 11           # change one token ...
    x2[:, k + 3:] = (x[:, k + 3:] + 5) % 11  # ... and several later ones
    with torch.no_grad():
        a, b = m(x), m(x2)
    assert torch.allclose(a[:, :k], b[:, :k], atol=1e-5)   # positions before k see nothing of it
    assert (a[:, k] - b[:, k]).abs().max() > 1e-3          # position k does see it
    # ... and attention does carry the past forward: the first token changes the last logits.
    x3 = x.clone()
    x3[:, 0] = (x[:, 0] + 1) % 11
    with torch.no_grad():
        c = m(x3)
    assert (a[:, -1] - c[:, -1]).abs().max() > 1e-4


def test_without_mask_the_future_leaks(one_thread):
    """The causality test above can fail: the same blocks without the causal mask leak."""
    m = _small()
    x = torch.randint(0, 11, (2, 16))
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % 11
    with torch.no_grad():
        def unmasked(ids):
            h = m.embed(ids) + m.pos(torch.arange(ids.shape[1]))
            return m.head(m.norm(m.blocks(h)))
        a, b = unmasked(x), unmasked(x2)
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-4


def test_argument_errors():
    with pytest.raises(ValueError, match="vocab_size"):
        CharTransformer(1)
    with pytest.raises(ValueError, match="d_model"):
        CharTransformer(11, d_model=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        CharTransformer(11, layers=0)
    with pytest.raises(ValueError, match="dropout"):
        CharTransformer(11, dropout=1.0)
    with pytest.raises(ValueError, match="context"):
        _small()(torch.zeros(1, 17, dtype=torch.int64))


def test_training_reduces_loss(one_thread):
    text = "And God said, Let there be light: and there was light.\n" * 20
    vocab = kjv.build_vocab(text)
    x, y = kjv.make_windows(kjv.encode(text, vocab), 16)
    m = _small(vocab_size=len(vocab))
    opt = get_workload("kjv-transformer").make_optimizer(m.parameters(), lr=3e-3)
    assert isinstance(opt, torch.optim.AdamW)
    losses = []
    for _ in range(40):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x[:8]).transpose(1, 2), y[:8])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.5, losses


def test_workload_model():
    w = get_workload("kjv-transformer")
    assert w.model == "char-transformer" and w.optimizer == "adamw"
    torch.manual_seed(0)
    m = w.make_model()
    assert m.context == TRANSFORMER_CONTEXT == 256 and m.channels_first
    d = w.describe()
    assert d["parameters"] == sum(p.numel() for p in m.parameters()) == 844_873
    assert d["gradient_bytes"] == 4 * d["parameters"]
    assert d["batch_size"] == 16 and d["train_samples"] == TRANSFORMER_TRAIN_WINDOWS
    assert d["input"] == "int64 [256]" and d["metric"] == "bits per character"
    assert w.extra_metrics(math.log(2) * 1.5, 0.0) == {"bits_per_char": pytest.approx(1.5)}
    with pytest.raises(ValueError, match="char-transformer"):
        get_workload("kjv-transformer", "resnet18")


@needs_kjv
def test_kjv_transformer_data():
    train_x, train_y, val_x, val_y = get_workload("kjv-transformer").load(None)
    base_x, _, base_vx, base_vy, _ = kjv.load(seq_len=256)
    assert train_x.shape == base_x.shape and train_x.shape[1] == 256
    assert torch.equal(val_x, base_vx) and torch.equal(val_y, base_vy)
    assert torch.equal(train_x[:, 1:], train_y[:, :-1])
    # The training windows are a permutation of the contiguous windows ...
    # (integer keys: a float matrix product may round a row differently at another row position)
    w = torch.randint(0, 2**20, (256,), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    key_shuffled, key_base = (train_x.long() * w).sum(1), (base_x.long() * w).sum(1)
    assert torch.equal(key_shuffled.sort().values, key_base.sort().values)
    # ... so the default slice of 12,800 covers the whole training text, not its first books.
    where = {k: i for i, k in enumerate(key_base.tolist())}
    positions = torch.tensor([where[k] for k in key_shuffled[:TRANSFORMER_TRAIN_WINDOWS].tolist()])
    n = base_x.shape[0]
    assert positions.min() < 0.05 * n and positions.max() > 0.95 * n
    assert abs(positions.double().mean().item() - n / 2) < 0.05 * n
