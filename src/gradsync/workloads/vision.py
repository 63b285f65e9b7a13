"""torchvision's image-classification models, randomly initialised, for 1x28x28 inputs or ImageNet size.

The architectures are torchvision's own (``torchvision.models.get_model(name, weights=None)``), so
``resnet50`` here is exactly the library's ResNet-50 (He et al. 2016, "Deep Residual Learning for
Image Recognition", arXiv:1512.03385, Table 1). No weights are downloaded.

**Small grey inputs** (:func:`build` with ``small_input=True``, Fashion-MNIST's 1x28x28): the model's
first convolution takes 1 input channel instead of 3 and stride 1 instead of its ImageNet stride;
everything else, the classifier with ``num_classes`` outputs included, is the library's. The first
convolution keeps its kernel, padding and output channels and the library's random initial weights
of input channel 0. Stride 1 keeps the feature maps large enough for the downsampling meant for
224x224 (ResNet-50 then ends on 2x2 maps instead of 7x7), as the CIFAR variants of these networks
do (He et al. 2016, section 4.2; Sandler et al. 2018, "MobileNetV2", arXiv:1801.04381).
:data:`SMALL_INPUT_MODELS` lists the models this adaptation is tested with; VGG, Inception-v3, ViT
and MaxViT need larger inputs and are not offered.

**Installing torchvision beside a CPU-only torch.** The torchvision wheel on PyPI (0.28.0 for torch
2.13.0) is built against the CUDA build of torch; beside the CPU build its C++ extension
(``torchvision/_C.so``, the detection operators ``nms``, ``roi_align``, ...) cannot load, and
``import torchvision`` then fails with ``RuntimeError: operator torchvision::nms does not exist``:
``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` without checking that the extension loaded (its other registrations check).
:func:`torchvision_models` retries such a failed import after defining those two operator schemas
(no kernels; :func:`gradsync.extras.define_missing_torchvision_ops`, which ``make setup`` also runs
before any first ``import torchvision`` through a ``.pth`` start-up hook, so Lightning and Transformers
import it in any order), which is all the import needs; the models are plain ``torch.nn`` and work. The
detection operators stay unavailable and raise torchvision's own "Couldn't load custom C++ ops"
``RuntimeError`` if called. Where the extension loads (a matching CUDA build of torch), the import
succeeds the first time and nothing is defined.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import torch
from torch import nn

# Image-classification models offered for 1x28x28 inputs (tested: build, forward and backward).
SMALL_INPUT_MODELS: tuple[str, ...] = (
    "resnet18", "resnet34", "resnet50", "resnext50_32x4d", "wide_resnet50_2",
    "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0",
    "shufflenet_v2_x1_0", "squeezenet1_1", "densenet121", "regnet_y_400mf", "mnasnet1_0",
    "googlenet", "convnext_tiny", "swin_t",
)
# Builder arguments that differ from torchvision's defaults: GoogLeNet's auxiliary classifiers return
# a tuple in training mode (a loss of logits needs one tensor); init_weights=True is its current
# initialisation, passed to silence its FutureWarning.
_EXTRA_ARGS: dict[str, dict[str, Any]] = {"googlenet": {"aux_logits": False, "init_weights": True}}


def _purge_torchvision() -> None:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]


def torchvision_models() -> types.ModuleType:
    """``torchvision.models``, importing torchvision beside a CPU-only torch if needed (see the module
    docstring).

    Raises:
        ImportError: if torchvision is not installed, or cannot be imported even with the operator
            schemas defined; the message says what to install.
    """
    from ..extras import define_missing_torchvision_ops

    try:
        import torchvision.models as models
        return models
    except ModuleNotFoundError as exc:
        if exc.name != "torchvision":
            raise
        raise ImportError("torchvision models need the 'torchvision' package, which is not installed: "
                          "pip install 'gradsync[vision]'") from exc
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        first_error = exc
    _purge_torchvision()
    if not define_missing_torchvision_ops():
        raise ImportError(f"torchvision cannot be imported beside torch {torch.__version__}: {first_error}") \
            from first_error
    try:
        import torchvision.models as models
    except Exception as exc:  # noqa: BLE001 - reported with the original failure
        _purge_torchvision()
        raise ImportError(f"torchvision cannot be imported beside torch {torch.__version__}: "
                          f"{first_error}; after defining the missing operators: {exc}") from exc
    return models


def _first_conv(model: nn.Module) -> tuple[str, nn.Conv2d]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return name, module
    raise ValueError(f"{type(model).__name__} has no Conv2d to adapt")


def build(name: str, num_classes: int = 10, in_channels: int = 1, small_input: bool = True) -> nn.Module:
    """torchvision model ``name``, randomly initialised (``weights=None``), with ``num_classes`` outputs.

    Args:
        name: a torchvision classification model; with ``small_input`` one of
            :data:`SMALL_INPUT_MODELS`, otherwise any name ``torchvision.models.list_models`` gives
            for ``torchvision.models`` (classification).
        num_classes: logits per sample (>= 2).
        in_channels: image channels (1 or 3); must be 3 unless ``small_input`` (the first
            convolution is only adapted for small inputs).
        small_input: adapt the first convolution for 28x28 inputs (1 input channel when
            ``in_channels`` is 1, stride 1); False leaves the library's ImageNet model unchanged.

    Returns:
        An ``nn.Module`` mapping float32 ``[B, in_channels, H, W]`` to logits float32
        ``[B, num_classes]`` (H = W = 28 for small inputs; 224 for the ImageNet models).

    Raises:
        ValueError: for a name outside the allowed list (listing it), ``num_classes < 2``, or
            ``in_channels`` not 1 or 3 (or not 3 without ``small_input``).
        ImportError: from :func:`torchvision_models`.
    """
    models = torchvision_models()
    allowed = SMALL_INPUT_MODELS if small_input else tuple(models.list_models(module=models))
    if name not in allowed:
        raise ValueError(f"model must be one of {', '.join(allowed)}; got {name!r}")
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2; got {num_classes!r}")
    if in_channels not in ((1, 3) if small_input else (3,)):
        raise ValueError(f"in_channels must be {'1 or 3' if small_input else '3 for ImageNet-size models'}; "
                         f"got {in_channels!r}")
    model = models.get_model(name, weights=None, num_classes=num_classes, **_EXTRA_ARGS.get(name, {}))
    if small_input:
        _, conv = _first_conv(model)
        if conv.groups != 1:
            raise ValueError(f"{name}: the first convolution is grouped; cannot adapt it")
        conv.stride = (1, 1)
        if in_channels != conv.in_channels:
            conv.in_channels = in_channels
            conv.weight = nn.Parameter(conv.weight.detach()[:, :in_channels].clone())
    return model


def imagenet_profile_target(name: str = "resnet50", batch_size: int = 32, seed: int = 0
                            ) -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]], Callable]:
    """``(model, make_batch, loss_fn)`` for profiling torchvision model ``name`` at ImageNet size.

    ``model`` is the library's model unchanged (3x224x224 inputs, 1000 classes, random weights);
    each ``make_batch()`` call returns fresh random images float32 ``[batch_size, 3, 224, 224]`` and
    labels int64 ``[batch_size]`` in 0..999 from a generator seeded with ``seed``; ``loss_fn`` is
    ``F.cross_entropy``. ResNet-50 has 25,557,032 parameters (102.2 MB of fp32 gradients).

    Raises:
        ValueError: for an unknown model name or ``batch_size < 1``.
        ImportError: from :func:`torchvision_models`.
    """
    import torch.nn.functional as F

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
    torch.manual_seed(seed)
    model = build(name, num_classes=1000, in_channels=3, small_input=False)
    g = torch.Generator().manual_seed(seed)

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(batch_size, 3, 224, 224, generator=g),
                torch.randint(0, 1000, (batch_size,), generator=g))

    return model, make_batch, F.cross_entropy
