"""Workloads: torchvision models for 1x28x28 inputs, the optimizer choice, describe(), and a real
2-rank DDP step with each new model compared against the average of per-rank gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsync.workloads import WORKLOADS, Recipe, describe_all, get_workload
from gradsync.workloads.vision import SMALL_INPUT_MODELS, build, imagenet_profile_target, torchvision_models

from distributed import run_ranks


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_torchvision_imports():
    models = torchvision_models()
    import torchvision

    assert torchvision.__version__.startswith("0.28.0")
    assert models.get_model_builder("resnet18") is models.resnet18
    assert set(SMALL_INPUT_MODELS) <= set(models.list_models(module=models))


def test_detection_ops_fail_clearly_without_the_extension():
    torchvision_models()
    import torchvision
    import torchvision.ops

    if torchvision.extension._has_ops():
        pytest.skip("torchvision's C++ extension loaded (a matching torch build): nothing to check")
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(torch.rand(3, 4), torch.rand(3), 0.5)


@pytest.mark.parametrize("name", SMALL_INPUT_MODELS)
def test_small_input_model_forward_backward(name, one_thread):
    torch.manual_seed(0)
    m = build(name)
    x = torch.randn(2, 1, 28, 28)
    out = m(x)
    assert out.shape == (2, 10) and out.dtype == torch.float32
    F.cross_entropy(out, torch.tensor([1, 7])).backward()
    # Every parameter gets a finite gradient: DDP needs no find_unused_parameters.
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_first_convolution_adaptation():
    models = torchvision_models()
    torch.manual_seed(0)
    lib = models.resnet18(weights=None, num_classes=10)
    torch.manual_seed(0)
    ours = build("resnet18")
    assert ours.conv1.in_channels == 1 and ours.conv1.stride == (1, 1)
    assert ours.conv1.weight.shape == (64, 1, 7, 7) and ours.conv1.kernel_size == (7, 7)
    # The library's initial weights of input channel 0; everything else is the library's model.
    assert torch.equal(ours.conv1.weight, lib.conv1.weight[:, :1])
    n_lib = sum(p.numel() for p in lib.parameters())
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_lib - n_ours == 64 * 2 * 7 * 7
    assert torch.equal(ours.fc.weight, lib.fc.weight)
    # Three channels: only the stride changes.
    rgb = build("mobilenet_v3_small", num_classes=5, in_channels=3)
    assert rgb.features[0][0].in_channels == 3 and rgb.features[0][0].stride == (1, 1)
    assert rgb(torch.randn(2, 3, 28, 28)).shape == (2, 5)


def test_build_argument_errors():
    with pytest.raises(ValueError, match="model must be one of .*resnet18"):
        build("vgg11")
    with pytest.raises(ValueError, match="num_classes"):
        build("resnet18", num_classes=1)
    with pytest.raises(ValueError, match="in_channels"):
        build("resnet18", in_channels=2)
    with pytest.raises(ValueError, match="in_channels"):
        build("resnet50", 1000, 1, small_input=False)


def test_imagenet_profile_target_is_torchvision_resnet50(one_thread):
    models = torchvision_models()
    model, make_batch, loss_fn = imagenet_profile_target("resnet50", batch_size=1)
    assert type(model) is models.ResNet and model.conv1.stride == (2, 2) and model.conv1.in_channels == 3
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    x, y = make_batch()
    assert x.shape == (1, 3, 224, 224) and x.dtype == torch.float32
    assert y.shape == (1,) and y.dtype == torch.int64 and 0 <= int(y) < 1000
    x2, _ = make_batch()
    assert not torch.equal(x, x2)  # fresh batches
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (1, 1000) and torch.isfinite(loss_fn(out, y))
    with pytest.raises(ValueError, match="batch_size"):
        imagenet_profile_target("resnet50", batch_size=0)


def test_workload_with_model_and_defaults():
    base = get_workload("fashion-mnist")
    assert base.model == "resnet8" and base.optimizer == "sgd"
    assert get_workload("fashion-mnist", None) is base and base.with_model("resnet8") is base
    w = get_workload("fashion-mnist", "resnet18")
    assert w.model == "resnet18" and w.defaults == base.defaults and w.optimizer == "sgd"
    torch.manual_seed(0)
    assert w.make_model()(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    wide = get_workload("fashion-mnist", "resnet8-w32")  # gradsync's own model, not torchvision's
    assert wide.model == "resnet8-w32" and wide.defaults == base.defaults and wide.optimizer == "sgd"
    net = wide.make_model()
    assert isinstance(net, type(base.make_model())) and net.stem[0].out_channels == 32
    r = wide.describe()
    assert (r["parameters"], r["gradient_bytes"]) == (308_074, 1_232_296)
    import gradsync.workloads as pkg

    assert "308,074" in pkg.__doc__ and "1,232,296" in pkg.__doc__
    vit, gru = get_workload("fashion-mnist", "vit-tiny"), get_workload("fashion-mnist", "gru")
    assert vit.optimizer == "adamw" and vit.defaults["lr"] == 1e-3 and gru.optimizer == "sgd"
    assert vit.describe()["parameters"] == 139_018 and gru.describe()["parameters"] == 161_034
    mixer = get_workload("fashion-mnist", "mixer")
    assert mixer.optimizer == "adamw" and mixer.defaults == vit.defaults and mixer.describe()["parameters"] == 94_734
    mlp = get_workload("fashion-mnist", "mlp")
    assert mlp.optimizer == "sgd" and mlp.defaults == base.defaults and mlp.describe()["parameters"] == 669_706
    mobilenet = get_workload("fashion-mnist", "mobilenet")
    assert (mobilenet.optimizer == "sgd" and mobilenet.defaults == base.defaults
            and mobilenet.describe()["parameters"] == 161_418)
    lenet = get_workload("fashion-mnist", "lenet")
    assert lenet.optimizer == "sgd" and lenet.defaults == base.defaults and lenet.describe()["parameters"] == 281_034
    tcn = get_workload("fashion-mnist", "tcn")
    assert tcn.optimizer == "sgd" and tcn.defaults == base.defaults and tcn.describe()["parameters"] == 69_706
    s4d = get_workload("fashion-mnist", "s4d")
    assert s4d.optimizer == "sgd" and s4d.defaults == base.defaults and s4d.describe()["parameters"] == 64_522
    densenet = get_workload("fashion-mnist", "densenet")
    assert densenet.optimizer == "sgd" and densenet.defaults == base.defaults and densenet.describe()["parameters"] == 76_770
    squeezenet = get_workload("fashion-mnist", "squeezenet")
    assert (squeezenet.optimizer == "sgd" and squeezenet.defaults == base.defaults
            and squeezenet.describe()["parameters"] == 87_210)
    vgg = get_workload("fashion-mnist", "vgg")
    assert vgg.optimizer == "sgd" and vgg.defaults == base.defaults and vgg.describe()["parameters"] == 199_994
    for m in (vit.make_model(), gru.make_model(), mixer.make_model(), mlp.make_model(), mobilenet.make_model(),
              lenet.make_model(), tcn.make_model(), s4d.make_model(), densenet.make_model(), squeezenet.make_model(),
              vgg.make_model()):
        assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    from gradsync.workloads.mobilenet import TinyMobileNet

    with pytest.raises(ValueError, match="expansion >= 1"):
        TinyMobileNet(blocks=((0, 16, 1),))
    from gradsync.workloads.lenet import LeNet

    with pytest.raises(ValueError, match="widths and hidden must be >= 1"):
        LeNet(hidden=0)
    from gradsync.workloads.tcn import RowTCN

    with pytest.raises(ValueError, match="kernel >= 2"):
        RowTCN(kernel=1)
    causal = RowTCN()  # the last time step sees every row; no step sees a later row
    x = torch.randn(1, 1, 28, 28, requires_grad=True)
    causal.blocks(x.flatten(1, 2).transpose(1, 2))[0, :, 10].sum().backward()
    seen = x.grad[0, 0].abs().sum(1)
    assert bool((seen[:11] > 0).all()) and bool((seen[11:] == 0).all())
    causal.zero_grad()
    x.grad = None
    causal(x).sum().backward()
    assert bool((x.grad[0, 0].abs().sum(1) > 0).all())
    from gradsync.workloads.densenet import TinyDenseNet

    with pytest.raises(ValueError, match="growth, every block's layers and classes must be >= 1"):
        TinyDenseNet(layers=())
    dense = TinyDenseNet(growth=4, layers=(2, 3))  # every layer adds 4 maps; the transition halves 16 to 8
    assert [m.out_channels for m in dense.modules() if isinstance(m, torch.nn.Conv2d)] == [8, 16, 4, 16, 4, 8, 16, 4,
                                                                                          16, 4, 16, 4]
    assert dense.head.in_features == 20
    from gradsync.workloads.squeezenet import TinySqueezeNet

    with pytest.raises(ValueError, match="Fire widths that are even"):
        TinySqueezeNet(widths=(8, 7))
    fire = TinySqueezeNet(widths=(4, 16, 32))  # squeeze to 1/8, two expands of half the width side by side
    assert [m.out_channels for m in fire.modules() if isinstance(m, torch.nn.Conv2d)] == [4, 2, 8, 8, 2, 8, 8, 4, 16,
                                                                                         16, 4, 16, 16, 10]
    assert fire(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    from gradsync.workloads.vgg import TinyVGG

    with pytest.raises(ValueError, match="stacks must be 1 to 5 stacks"):
        TinyVGG(stacks=((1, 8), (0, 16)))
    plain = TinyVGG(stacks=((1, 4), (2, 8)))  # 3x3 convolutions only, a pool between stacks, no skip connection
    assert [m.out_channels for m in plain.modules() if isinstance(m, torch.nn.Conv2d)] == [4, 8, 8]
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in plain.modules()) == 1 and plain.head[-1].in_features == 8
    from gradsync.workloads.ssm import RowS4D, _CausalFFTConv

    with pytest.raises(ValueError, match="modes, layers and classes must be >= 1"):
        RowS4D(modes=0)
    u, k = torch.randn(2, 3, 9, dtype=torch.float64, requires_grad=True), torch.randn(3, 9, dtype=torch.float64,
                                                                                        requires_grad=True)
    assert torch.autograd.gradcheck(_CausalFFTConv.apply, (u, k))  # the written-out backward pass
    causal = RowS4D()  # the mean over time sees every row; no step of the blocks sees a later row
    x = torch.randn(1, 1, 28, 28, requires_grad=True)
    causal.blocks(causal.encoder(x.flatten(1, 2).transpose(1, 2)))[0, :, 10].sum().backward()
    seen = x.grad[0, 0].abs().sum(1)  # later rows: the FFTs' float32 round-off only
    assert bool((seen[:11] > 0).all()) and bool((seen[11:] < 1e-5 * seen[:11].min()).all())
    causal.zero_grad()
    x.grad = None
    causal(x).sum().backward()
    assert bool((x.grad[0, 0].abs().sum(1) > 0).all())
    swin = get_workload("fashion-mnist", "swin_t")
    assert swin.optimizer == "adamw" and swin.defaults["lr"] == 1e-3 and swin.defaults["batch_size"] == 64
    assert WORKLOADS["fashion-mnist"].model == "resnet8"  # the registry entry is unchanged
    with pytest.raises(ValueError, match="model for workload fashion-mnist must be one of resnet8, resnet8-w32, vit-tiny, "
                                         "gru, mixer, mlp, mobilenet, lenet, tcn, s4d, densenet, squeezenet, vgg, resnet18"):
        get_workload("fashion-mnist", "vgg11")
    with pytest.raises(ValueError, match="model for workload kjv-lstm must be one of char-lstm"):
        get_workload("kjv-lstm", "resnet18")
    with pytest.raises(ValueError, match="workload must be one of"):
        get_workload("cifar10")


def test_make_optimizer():
    p = [nn.Parameter(torch.ones(3))]
    sgd = get_workload("fashion-mnist").make_optimizer(p, lr=0.1, momentum=0.9, weight_decay=5e-4)
    assert isinstance(sgd, torch.optim.SGD)
    g = sgd.param_groups[0]
    assert g["nesterov"] and g["momentum"] == 0.9 and g["weight_decay"] == 5e-4 and g["lr"] == 0.1
    plain = get_workload("kjv-lstm").make_optimizer(p, lr=1.0, momentum=0.0)
    assert not plain.param_groups[0]["nesterov"]
    adamw = get_workload("kjv-transformer").make_optimizer(p, lr=3e-3, momentum=0.9, weight_decay=0.01)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["weight_decay"] == 0.01
    for kwargs, arg in (({"lr": 0.0}, "lr"), ({"lr": 0.1, "momentum": 1.0}, "momentum"),
                        ({"lr": 0.1, "weight_decay": -1.0}, "weight_decay")):
        with pytest.raises(ValueError, match=arg):
            get_workload("fashion-mnist").make_optimizer(p, **kwargs)
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adamw"):
        Recipe(batch_size=64, epochs=1, lr=0.1, optimizer="adam")
    for bad in ({"warmup_fraction": 1.0}, {"lr": 0.0}, {"momentum": 1.0}, {"epochs": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Recipe(**{"batch_size": 64, "epochs": 1, "lr": 0.1, **bad})


def test_describe_matches_the_models_and_the_docstring():
    import gradsync.workloads as pkg

    rows = {(r["workload"], r["model"]): r for r in describe_all(models=False)}
    assert set(rows) == {("fashion-mnist", "resnet8"), ("kjv-lstm", "char-lstm"),
                         ("kjv-transformer", "char-transformer")}
    for (name, _), r in rows.items():
        m = WORKLOADS[name].make_model()
        assert r["parameters"] == sum(p.numel() for p in m.parameters())
        assert r["gradient_bytes"] == 4 * r["parameters"]
        assert r["batch_size"] == WORKLOADS[name].defaults["batch_size"]
        # The table in the package docstring quotes these figures.
        assert f"{r['parameters']:,}" in pkg.__doc__ and f"{r['gradient_bytes']:,}" in pkg.__doc__
    # describe() leaves the global RNG alone.
    torch.manual_seed(5)
    a = torch.rand(1)
    torch.manual_seed(5)
    get_workload("fashion-mnist", "resnet18").describe()
    assert torch.equal(torch.rand(1), a)
    assert get_workload("fashion-mnist", "resnet18").describe()["parameters"] == 11_175_370


# ---- a real 2-rank DDP step with each new model ----

def _model_and_batch(kind: str, rank: int):
    """Identical model on every rank (seed 0) and rank ``rank``'s own batch."""
    torch.manual_seed(0)
    if kind == "kjv-transformer":
        from gradsync.workloads.transformer import CharTransformer

        model = CharTransformer(73, context=256, d_model=32, heads=4, layers=2, dropout=0.1, channels_first=True)
        g = torch.Generator().manual_seed(10 + rank)
        return model, torch.randint(0, 73, (2, 64), generator=g), torch.randint(0, 73, (2, 64), generator=g)
    model = get_workload("fashion-mnist", kind).make_model()
    g = torch.Generator().manual_seed(10 + rank)
    return model, torch.randn(2, 1, 28, 28, generator=g), torch.randint(0, 10, (2,), generator=g)


def _local_grad(kind: str, rank: int) -> torch.Tensor:
    model, x, y = _model_and_batch(kind, rank)
    torch.manual_seed(100 + rank)  # the same dropout / stochastic-depth draws as the rank
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _ddp_step(rank, world, kinds):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        model, x, y = _model_and_batch(kind, rank)
        ddp = DDP(model, bucket_cap_mb=1)
        torch.manual_seed(100 + rank)
        F.cross_entropy(ddp(x), y).backward()
        out[kind] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return out


def test_ddp_step_with_each_new_model(one_thread):
    kinds = ["resnet18", "mobilenet_v3_small", "kjv-transformer"]
    torchvision_models()  # import once before the ranks fork
    results = run_ranks(_ddp_step, 2, kinds, timeout=240, pg_timeout=120)
    for kind in kinds:
        reference = (_local_grad(kind, 0) + _local_grad(kind, 1)) / 2
        g0, g1 = results[0][kind], results[1][kind]
        assert torch.equal(g0, g1), kind  # every rank holds the same averaged gradient
        # fp32 sums in a different order: agree to a few ulps of the gradient scale.
        scale = reference.abs().max().item()
        assert torch.allclose(g0, reference, rtol=1e-4, atol=1e-6 * scale), kind
        # ... and it is the average, not one rank's own gradient.
        assert not torch.allclose(g0, _local_grad(kind, 0), rtol=1e-3, atol=1e-4 * scale), kind


def test_truncated_or_damaged_idx_file_names_the_file(tmp_path):
    from gradsync.workloads.fashion_mnist import DatasetCorrupt, read_idx

    good = tmp_path / "labels-idx1-ubyte"
    good.write_bytes((0x801).to_bytes(4, "big") + (5).to_bytes(4, "big") + bytes(range(5)))
    assert read_idx(good).tolist() == [0, 1, 2, 3, 4]
    short = tmp_path / "short-idx1-ubyte"
    short.write_bytes(good.read_bytes()[:-2])
    with pytest.raises(DatasetCorrupt, match=f"{short}: 11 bytes, but its header \\(shape \\(5,\\)\\) needs 13"):
        read_idx(short)
    bad = tmp_path / "bad.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetCorrupt, match=f"{bad}: truncated or damaged gzip file"):
        read_idx(bad)


def test_recipes_are_the_defaults_of_train_and_bench_and_flags_override_them():
    from gradsync.bench.config import BenchConfig
    from gradsync.train.config import TrainConfig

    for name, w in WORKLOADS.items():
        r, cfg, bench = w.recipe, TrainConfig(workload=name), BenchConfig(workload=name)
        assert (cfg.batch_size, cfg.epochs, cfg.lr, cfg.warmup_fraction, cfg.weight_decay, cfg.momentum,
                cfg.train_samples) == (r.batch_size, r.epochs, r.lr, r.warmup_fraction, r.weight_decay, r.momentum,
                                       r.train_samples)
        assert (bench.batch_size, bench.epochs, bench.lr, bench.train_samples) == (r.batch_size, r.epochs, r.lr,
                                                                                     r.train_samples)
    cfg = TrainConfig(lr=0.02, momentum=0.0, warmup_fraction=0.3, batch_size=32)
    assert (cfg.lr, cfg.momentum, cfg.warmup_fraction, cfg.batch_size) == (0.02, 0.0, 0.3, 32)
    with pytest.raises(ValueError, match="warmup_fraction"):
        TrainConfig(warmup_fraction=1.0)


def _evaluate_in_batches(rank, world):
    from gradsync.train.evaluate import CPU_EVAL_BATCH, evaluate

    torch.manual_seed(0)
    model = get_workload("fashion-mnist").make_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(301, 1, 28, 28, generator=g), torch.randint(0, 10, (301,), generator=g)
    assert CPU_EVAL_BATCH < 301 // world  # several batches per rank
    return evaluate(model, x, y, torch.device("cpu")), evaluate(model, x, y, torch.device("cpu"), batch=1000)


def test_evaluation_in_cpu_batches_gives_the_whole_sets_loss_and_accuracy():
    """train.evaluate's CPU batches (CPU_EVAL_BATCH samples per forward pass, for speed) give every rank the
    loss and accuracy of the whole set, as one forward pass per rank does (loss to float32 summation order)."""
    for (loss, acc), (loss1, acc1) in run_ranks(_evaluate_in_batches, 2):
        assert acc == acc1 and loss == pytest.approx(loss1, rel=1e-5)
