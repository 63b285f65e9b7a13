"""Training workloads: a real dataset plus a model sized for this kind of machine.

=================  =====================  ==========  ==============  =====  ======  =========
workload           model (default)        parameters  gradient bytes  batch  optim.  metric
=================  =====================  ==========  ==============  =====  ======  =========
fashion-mnist      resnet8 (ResNetFMNIST)      77,754         311,016     64  SGD     accuracy
kjv-lstm           char-lstm (2x256 LSTM)     879,497       3,517,988     32  SGD     bits/char
kjv-transformer    char-transformer           844,873       3,379,492     16  AdamW   bits/char
=================  =====================  ==========  ==============  =====  ======  =========

Gradient bytes are those of one fp32 gradient of every trainable parameter (what dense all-reduce
moves per rank and step); batch is the default per-rank batch (sequences of 128 characters for
kjv-lstm, 256 for kjv-transformer). ``fashion-mnist`` also trains ``resnet8-w32`` (the same ResNet-8
at width 32: 308,074 parameters, 1,232,296 gradient bytes) and torchvision's models
(``get_workload("fashion-mnist", model="resnet18")``, names in :data:`vision.SMALL_INPUT_MODELS`);
:func:`describe_all` gives this table's figures for every workload and model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import fashion_mnist
from .resnet import ResNetFMNIST
from .rnn import RowGRU
from .vit import TinyViT
from .mixer import TinyMixer
from .mlp import MLP
from .mobilenet import TinyMobileNet
from .lenet import LeNet
from .tcn import RowTCN
from .ssm import RowS4D
from .densenet import TinyDenseNet
from .squeezenet import TinySqueezeNet
from .vgg import TinyVGG

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class Recipe:
    """A workload's training recipe: what ``gradsync train`` and ``gradsync bench --to-quality`` use
    where no flag says otherwise.

    The learning rate follows a one-cycle schedule (Smith & Topin 2019, "Super-Convergence",
    arXiv:1708.07120, section 3; ``torch.optim.lr_scheduler.OneCycleLR`` with cosine annealing): a
    cosine warm-up over the first ``warmup_fraction`` of the budget to ``lr``, then a cosine decay to
    ``lr / 1e4`` at the end of the budget. It is the schedule ``gradsync train`` checkpoints and resumes
    (:func:`gradsync.train.loop.continue_schedule`), so one schedule serves train and bench.

    Fields: ``batch_size`` samples per step per rank; ``epochs`` the budget in passes over the training
    set (the first ``train_samples`` samples where given: the text workloads' budget in windows, i.e.
    ``epochs * train_samples / (batch_size * world size)`` steps); ``lr`` the peak learning rate;
    ``warmup_fraction`` in (0, 1); ``weight_decay`` (L2 for SGD, decoupled for AdamW) >= 0;
    ``momentum`` in [0, 1) (SGD with Nesterov momentum; unused by AdamW); ``optimizer`` one of
    :data:`OPTIMIZERS`.

    Raises:
        ValueError: on construction, naming the field and its allowed range.
    """

    batch_size: int
    epochs: int
    lr: float
    warmup_fraction: float = 0.15
    weight_decay: float = 5e-4
    momentum: float = 0.9
    optimizer: str = "sgd"
    train_samples: int | None = None

    def __post_init__(self) -> None:
        checks = {"batch_size": self.batch_size >= 1, "epochs": self.epochs >= 1, "lr": self.lr > 0,
                  "warmup_fraction": 0 < self.warmup_fraction < 1, "weight_decay": self.weight_decay >= 0,
                  "momentum": 0 <= self.momentum < 1,
                  "train_samples": self.train_samples is None or self.train_samples >= 1}
        allowed = {"batch_size": ">= 1", "epochs": ">= 1", "lr": "> 0", "warmup_fraction": "in (0, 1)",
                   "weight_decay": ">= 0", "momentum": "in [0, 1)", "train_samples": "None or >= 1"}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed[name]}; got {getattr(self, name)!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")

    def defaults(self) -> dict[str, Any]:
        """The recipe as ``gradsync train``'s defaults: every field but ``optimizer`` (and
        ``train_samples`` when None)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "optimizer"}
        if self.train_samples is None:
            del out["train_samples"]
        return out


@dataclass(frozen=True)
class Workload:
    """A dataset loader and model factory.

    ``load(data_dir)`` returns ``(train_x, train_y, test_x, test_y)`` tensors; ``make_model()`` a
    fresh ``nn.Module`` whose output works with ``F.cross_entropy(out, y)`` (class dimension 1);
    ``augment(x)`` a batch transform applied in training only; ``recipe`` the training recipe
    (:class:`Recipe`; ``defaults`` is it as a dict) used where the user gives no flag;
    ``extra_metrics(test_loss, test_acc)`` workload-specific figures for the summary.

    ``model`` names the architecture ``make_model`` builds; ``model_choices`` the other models
    :meth:`with_model` can put in its place (torchvision's, for image workloads); ``input_shape``
    and ``input_dtype`` describe one sample of ``train_x``; ``num_classes`` the logits per
    position; ``optimizer`` (the recipe's, ``"sgd"`` or ``"adamw"``) what :meth:`make_optimizer`
    builds; ``metric`` the headline figure (``"test accuracy"`` or ``"bits per character"``);
    ``model_defaults[m]`` overrides recipe fields when :meth:`with_model` puts model ``m`` in;
    ``native_models[m]`` builds model ``m`` where it is gradsync's own rather than torchvision's.
    """

    name: str
    load: Callable[[str | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    make_model: Callable[[], nn.Module]
    augment: Callable[[torch.Tensor], torch.Tensor]
    recipe: Recipe
    extra_metrics: Callable[[float, float], dict[str, float]] = lambda loss, acc: {}
    model: str = "custom"
    model_choices: tuple[str, ...] = ()
    input_shape: tuple[int, ...] = ()
    input_dtype: torch.dtype = torch.float32
    num_classes: int = 0
    model_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    metric: str = "test accuracy"
    native_models: dict[str, Callable[[], nn.Module]] = field(default_factory=dict)

    @property
    def optimizer(self) -> str:
        """The recipe's optimizer family, ``"sgd"`` or ``"adamw"``."""
        return self.recipe.optimizer

    @property
    def key(self) -> str:
        """``workload:model`` (``fashion-mnist:resnet8``), the key of measured accuracy costs."""
        return f"{self.name}:{self.model}"

    @property
    def defaults(self) -> dict[str, Any]:
        """:meth:`Recipe.defaults` of this workload's recipe."""
        return self.recipe.defaults()

    def make_optimizer(self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.9,
                       weight_decay: float = 0.0) -> torch.optim.Optimizer:
        """The workload's optimizer over ``params``.

        ``"sgd"``: ``torch.optim.SGD(params, lr, momentum, weight_decay, nesterov=momentum > 0)``
        (Nesterov momentum as in Sutskever et al. 2013, "On the importance of initialization and
        momentum in deep learning", ICML, section 3). ``"adamw"``: ``torch.optim.AdamW(params, lr,
        betas=(0.9, 0.99), weight_decay=weight_decay)`` (Loshchilov & Hutter 2019, "Decoupled Weight
        Decay Regularization", arXiv:1711.05101, Algorithm 2); ``momentum`` is not used.

        Args:
            params: parameters (or parameter groups) to optimise.
            lr: learning rate (> 0).
            momentum: SGD momentum in [0, 1).
            weight_decay: L2 penalty (SGD) or decoupled decay rate (AdamW), >= 0.

        Raises:
            ValueError: for ``lr <= 0``, ``momentum`` outside [0, 1) or ``weight_decay < 0``.
        """
        if not lr > 0:
            raise ValueError(f"lr must be > 0; got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1); got {momentum}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0; got {weight_decay}")
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                               nesterov=momentum > 0)

    def with_model(self, model: str | None) -> "Workload":
        """This workload with architecture ``model`` (None or ``self.model``: unchanged).

        A model in ``native_models`` is built by its factory; a torchvision model by
        :func:`vision.build` for ``input_shape`` and ``num_classes`` (first convolution adapted to
        1x28x28); ``model_defaults[model]`` overrides ``defaults``
        (for example AdamW settings for ConvNeXt and Swin, trained with AdamW in their papers).

        Raises:
            ValueError: if ``model`` is neither ``self.model`` nor in ``model_choices`` (listing them).
        """
        if model is None or model == self.model:
            return self
        if model not in self.model_choices:
            allowed = ", ".join((self.model, *self.model_choices))
            raise ValueError(f"model for workload {self.name} must be one of {allowed}; got {model!r}")
        extra = {"optimizer": "sgd", **self.model_defaults.get(model, {})}
        if model in self.native_models:
            make_model = self.native_models[model]
        else:
            from . import vision

            make_model = partial(vision.build, model, self.num_classes, self.input_shape[0], True)
        return dataclasses.replace(
            self, model=model, recipe=dataclasses.replace(self.recipe, **extra), make_model=make_model)

    def describe(self) -> dict[str, Any]:
        """Figures for a README table (builds the model once; the global RNG is left as it was).

        Returns:
            ``{"workload", "model", "parameters", "gradient_bytes", "batch_size", "lr", "epochs",
            "optimizer", "input", "classes", "metric"}`` plus ``"train_samples"`` where the workload
            trains on a slice by default. ``gradient_bytes`` = bytes of one gradient of every
            trainable parameter (numel x element size, fp32: 4 bytes each); ``input`` describes one
            sample, e.g. ``"float32 [1, 28, 28]"``.
        """
        with torch.random.fork_rng(devices=[]):
            net = self.make_model()
        trainable = [p for p in net.parameters() if p.requires_grad]
        out = {
            "workload": self.name,
            "model": self.model,
            "parameters": sum(p.numel() for p in trainable),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "batch_size": self.defaults.get("batch_size"),
            "lr": self.defaults.get("lr"),
            "epochs": self.defaults.get("epochs"),
            "optimizer": self.optimizer,
            "input": f"{str(self.input_dtype).removeprefix('torch.')} {list(self.input_shape)}",
            "classes": self.num_classes,
            "metric": self.metric,
        }
        if "train_samples" in self.defaults:
            out["train_samples"] = self.defaults["train_samples"]
        return out


def _load_fmnist(data_dir: str | None):
    return (*fashion_mnist.load(data_dir, "train"), *fashion_mnist.load(data_dir, "test"))


def _random_flip(x: torch.Tensor) -> torch.Tensor:
    """Horizontal flip of a random half of the batch ``[B, C, H, W]``."""
    flip = torch.rand(x.shape[0], device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def _load_kjv(data_dir: str | None):
    from . import kjv

    return kjv.load(data_dir)[:4]


def _kjv_model() -> nn.Module:
    from . import kjv
    from .charlstm import CharLSTM

    return CharLSTM(len(kjv.KJV_VOCAB), channels_first=True)


# kjv-transformer: context, width, heads, blocks (844,873 parameters) and the training slice.
TRANSFORMER_CONTEXT = 256
TRANSFORMER_SHAPE = {"d_model": 128, "heads": 4, "layers": 4}
TRANSFORMER_TRAIN_WINDOWS = 12800


def _load_kjv_transformer(data_dir: str | None):
    """KJV windows of 256 characters; the training windows in a fixed random order (seed 0), so the
    first N of them (``train_samples``) are a uniform sample of the whole training text rather than
    its first books. Validation: the last 5% of the text, in order."""
    from . import kjv

    train_x, train_y, val_x, val_y, _ = kjv.load(data_dir, seq_len=TRANSFORMER_CONTEXT)
    order = torch.randperm(train_x.shape[0], generator=torch.Generator().manual_seed(0))
    return train_x[order], train_y[order], val_x, val_y


def _kjv_transformer_model() -> nn.Module:
    from . import kjv
    from .transformer import CharTransformer

    return CharTransformer(len(kjv.KJV_VOCAB), TRANSFORMER_CONTEXT, channels_first=True, **TRANSFORMER_SHAPE)


def _bits_per_char(loss: float, acc: float) -> dict[str, float]:
    return {"bits_per_char": loss / math.log(2)}


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _vision_choices() -> tuple[str, ...]:
    from .vision import SMALL_INPUT_MODELS

    return (*_NATIVE_VISION, *SMALL_INPUT_MODELS)


# The same ResNet-8 at twice the width (308,074 parameters, 1.23 MB of fp32 gradients; 190 ms a step
# of batch 64 on one core here, against 69 ms at width 16): the grid's larger CNN, trained with the
# same SGD + Nesterov momentum recipe.
# A Vision Transformer of 139k parameters (gradsync.workloads.vit), trained with AdamW as ViTs are, and a GRU
# reading the rows (gradsync.workloads.rnn, the recipe's SGD): model families no accuracy row or rule of
# gradsync was tuned on (the out-of-sample tests of --algorithm auto). An MLP-Mixer of 95k parameters
# (gradsync.workloads.mixer), AdamW as the ViT: added after the ViT's rows entered the quality model's fit, as its
# next out-of-sample family. A plain MLP of 670k parameters (gradsync.workloads.mlp), the recipe's SGD: added
# after the probe's budget and timing race were frozen (eighth session), their out-of-sample family. A
# MobileNetV2-style depthwise-separable CNN of 161k parameters (gradsync.workloads.mobilenet), the recipe's SGD:
# added after the ninth session's probe changes were frozen, their out-of-sample family. A LeNet-5-style CNN of
# 281k parameters (gradsync.workloads.lenet), the recipe's SGD: added after the online probe was frozen
# (thirteenth session, 1cef260), its out-of-sample family. A temporal convolutional network of 70k parameters over
# the image rows (gradsync.workloads.tcn), the recipe's SGD: added after the online probe's joined torch PowerSGD
# was frozen (fifteenth session, 073ad38), its out-of-sample family. A diagonal state-space model (S4D) of 65k
# parameters over the image rows (gradsync.workloads.ssm), the recipe's SGD: added after the online probe's stage
# metering was frozen (sixteenth session), its out-of-sample family. A DenseNet-BC of 77k parameters
# (gradsync.workloads.densenet), the recipe's SGD: added (seventeenth session) as the second out-of-sample family
# of the same frozen rule (330a612). A SqueezeNet of 87k parameters (gradsync.workloads.squeezenet), the recipe's
# SGD: added (eighteenth session) after the online rule's lossless race and metering filter were frozen, their
# out-of-sample family. A VGG-style CNN of 200k parameters (gradsync.workloads.vgg), the recipe's SGD: added
# (nineteenth session) after the quality model's per-seed risk limit was frozen (4bedd88), its out-of-sample family.
_NATIVE_VISION: dict[str, Callable[[], nn.Module]] = {"resnet8-w32": lambda: ResNetFMNIST(32, (1, 1, 1)),
                                                      "vit-tiny": lambda: TinyViT(), "gru": lambda: RowGRU(),
                                                      "mixer": lambda: TinyMixer(), "mlp": lambda: MLP(),
                                                      "mobilenet": lambda: TinyMobileNet(), "lenet": lambda: LeNet(),
                                                      "tcn": lambda: RowTCN(), "s4d": lambda: RowS4D(),
                                                      "densenet": lambda: TinyDenseNet(),
                                                      "squeezenet": lambda: TinySqueezeNet(),
                                                      "vgg": lambda: TinyVGG()}


_KJV_VOCAB_SIZE = 73
_ADAMW_VISION = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.05}

WORKLOADS: dict[str, Workload] = {
    # The CIFAR-style ResNet-8 of width 16 (He et al. 2016, section 4.2) on Fashion-MNIST; --model
    # swaps in a torchvision classifier (dense accuracy under shorter budgets: docs/results.md, "Measurements
    # that were in module docstrings").
    "fashion-mnist": Workload(
        "fashion-mnist", _load_fmnist, lambda: ResNetFMNIST(16, (1, 1, 1)), _random_flip,
        Recipe(batch_size=64, epochs=4, lr=0.1, warmup_fraction=0.15, weight_decay=5e-4, momentum=0.9),
        model="resnet8", model_choices=_vision_choices(), input_shape=(1, 28, 28), num_classes=10,
        model_defaults={"convnext_tiny": _ADAMW_VISION, "swin_t": _ADAMW_VISION, "vit-tiny": _ADAMW_VISION,
                        "mixer": _ADAMW_VISION},
        native_models=_NATIVE_VISION),
    # Character-level LSTM language model on the King James Bible (GraVAC's LSTM workload);
    # test loss is nats per character, "accuracy" next-character accuracy.
    "kjv-lstm": Workload(
        "kjv-lstm", _load_kjv, _kjv_model, _identity,
        Recipe(batch_size=32, epochs=1, lr=2.0, warmup_fraction=0.15, weight_decay=5e-4, momentum=0.9),
        _bits_per_char,
        model="char-lstm", input_shape=(128,), input_dtype=torch.int64, num_classes=_KJV_VOCAB_SIZE,
        metric="bits per character"),
    # Decoder-only transformer language model on the same text, context 256, AdamW. One epoch is
    # 12,800 windows (3.3 M characters, 80% of the training text): 400 steps on 2 ranks, about
    # 3 minutes on 2 idle cores (0.45 s a step), validation 2.97 bits per character; at 200 steps it
    # is still on the 3.4-bit plateau that small character transformers leave only after ~200 steps.
    "kjv-transformer": Workload(
        "kjv-transformer", _load_kjv_transformer, _kjv_transformer_model, _identity,
        Recipe(batch_size=16, epochs=1, lr=3e-3, warmup_fraction=0.15, weight_decay=0.01, optimizer="adamw",
               train_samples=TRANSFORMER_TRAIN_WINDOWS), _bits_per_char,
        model="char-transformer", input_shape=(TRANSFORMER_CONTEXT,), input_dtype=torch.int64,
        num_classes=_KJV_VOCAB_SIZE, metric="bits per character"),
}


_LOADED: dict[tuple[str, str | None], tuple] = {}


def load_data(workload: Workload, data_dir: str | None) -> tuple:
    """``workload.load(data_dir)``, kept for the life of this process and of the ranks it forks: the
    launcher's data check loads the files once and forked ranks reuse those tensors (copy-on-write)
    instead of reading them again. Callers must not modify the tensors in place.

    Raises:
        whatever ``workload.load`` raises (FileNotFoundError, DatasetCorrupt).
    """
    key = (workload.name, data_dir)
    if key not in _LOADED:
        _LOADED[key] = workload.load(data_dir)
    return _LOADED[key]


def get_workload(name: str, model: str | None = None) -> Workload:
    """Workload ``name``, with architecture ``model`` in place of its default where given.

    Raises:
        ValueError: listing the known workloads, or (from :meth:`Workload.with_model`) the models
            workload ``name`` accepts.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    return WORKLOADS[name].with_model(model)


def describe_all(models: bool = True) -> list[dict[str, Any]]:
    """:meth:`Workload.describe` of every workload, then (``models``) of fashion-mnist with each
    of its other models. Builds every model once (seconds; needs torchvision for the second part)."""
    rows = [w.describe() for w in WORKLOADS.values()]
    if models:
        base = WORKLOADS["fashion-mnist"]
        rows += [base.with_model(m).describe() for m in base.model_choices]
    return rows
