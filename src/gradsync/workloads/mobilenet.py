"""A small MobileNetV2 for 1x28x28 images (Sandler et al., CVPR 2018, "MobileNetV2: Inverted Residuals and
Linear Bottlenecks", arXiv 1801.04381, §3.3 and Table 1): a 3x3 stem convolution of stride 2 (Table 1's first
row), inverted-residual blocks (a 1x1 expansion + BN + ReLU6, a depthwise 3x3 + BN + ReLU6, a linear 1x1
projection + BN; a skip connection where the stride is 1 and the channels are unchanged; expansion 1 drops the
expansion convolution, as in Table 1's first block), a final 1x1 convolution + BN + ReLU6, global average
pooling and a linear head. Sized for a 2-core CPU: stem 16 channels (28 -> 14), five blocks (expansion 1, 4,
4, 4, 4; channels 16, 32, 64, 64, 128; stride 2 in the first two: 14 -> 7 -> 4; the fourth has the skip
connection), final width 384. The resolution falls to 4x4 after two blocks because this CPU spends most of a
step on the depthwise convolutions and on the BN and ReLU6 of the expanded activations, which grow with the
pixels: with a stride-1 stem and six blocks ending at 7x7 (245k parameters) a forward and backward pass of
batch 64 on one thread took 345 ms here, with this one 53-59 ms (ResNet-8: 112-139 ms).

161,418 parameters (645,672 bytes of fp32 gradients): 146,688 (91 %) in the ten pointwise 1x1 matrices (the
largest the final 128 -> 384 convolution's, 49,152, and the last block's 256 -> 128 projection, 32,768), 6,480
in the depthwise 3x3 kernels, 144 in the stem, 4,256 in BN scales and shifts, 3,850 in the head.
"""

from __future__ import annotations

import torch
from torch import nn

# (expansion t, output channels c, stride s) of each inverted-residual block, as Table 1's rows with n = 1.
BLOCKS: tuple[tuple[int, int, int], ...] = ((1, 16, 2), (4, 32, 2), (4, 64, 1), (4, 64, 1), (4, 128, 1))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1,
             act: bool = True) -> nn.Sequential:
    """Conv (no bias) + BN (+ ReLU6): ``[B, cin, H, W]`` -> ``[B, cout, ceil(H / stride), ceil(W / stride)]``."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """One inverted-residual block (§3.3, Table 1): float32 ``[B, cin, H, W]`` ->
    ``[B, cout, ceil(H / stride), ceil(W / stride)]``.

    Args:
        cin: input channels.
        cout: output channels.
        expansion: hidden channels per input channel (``t``; 1 drops the expansion convolution, as in the
            paper's first block).
        stride: of the depthwise convolution, 1 or 2.

    Raises:
        ValueError: for ``cin`` or ``cout`` < 1, ``expansion`` < 1 or ``stride`` not 1 or 2.
    """

    def __init__(self, cin: int, cout: int, expansion: int, stride: int) -> None:
        super().__init__()
        if min(cin, cout) < 1:
            raise ValueError(f"cin and cout must be >= 1; got {cin}, {cout}")
        if expansion < 1:
            raise ValueError(f"expansion must be >= 1; got {expansion}")
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2; got {stride}")
        hidden = cin * expansion
        layers: list[nn.Module] = [_conv_bn(cin, hidden, 1)] if expansion != 1 else []
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden),  # depthwise
                   _conv_bn(hidden, cout, 1, act=False)]  # linear bottleneck: no ReLU6
        self.layers = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, cin, H, W]`` -> ``[B, cout, ceil(H / stride), ceil(W / stride)]``."""
        out = self.layers(x)
        return x + out if self.residual else out


class TinyMobileNet(nn.Module):
    """MobileNetV2 on float32 images ``[B, C, H, W]`` (``[B, 1, 28, 28]`` by default) -> logits ``[B, classes]``.

    Args:
        image: (channels, height, width) of the input.
        stem: channels of the 3x3 stem convolution (stride 2).
        blocks: ``(expansion, channels, stride)`` of each inverted-residual block.
        last: channels of the final 1x1 convolution.
        classes: output classes.

    Raises:
        ValueError: for ``stem``, ``last`` or ``classes`` < 1, an empty ``blocks``, or a block whose expansion
            or channels are < 1 or whose stride is not 1 or 2 (naming the argument and its allowed range).
    """

    def __init__(self, image: tuple[int, int, int] = (1, 28, 28), stem: int = 16,
                 blocks: tuple[tuple[int, int, int], ...] = BLOCKS, last: int = 384, classes: int = 10) -> None:
        super().__init__()
        for name, value in (("stem", stem), ("last", last), ("classes", classes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if not blocks:
            raise ValueError("blocks must hold at least one (expansion, channels, stride)")
        for t, c, s in blocks:
            if t < 1 or c < 1 or s not in (1, 2):
                raise ValueError(f"each of blocks must be (expansion >= 1, channels >= 1, stride 1 or 2); "
                                 f"got {(t, c, s)}")
        layers: list[nn.Module] = [_conv_bn(image[0], stem, 3, 2)]
        cin = stem
        for t, c, s in blocks:
            layers.append(InvertedResidual(cin, c, t, s))
            cin = c
        layers.append(_conv_bn(cin, last, 1))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(last, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, H, W]`` -> logits ``[B, classes]``."""
        return self.head(self.features(x).mean(dim=(2, 3)))
