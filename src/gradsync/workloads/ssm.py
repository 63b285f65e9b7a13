"""A diagonal state-space model (S4D) over the rows of 1x28x28 images (Gu, Gupta, Goel & Ré 2022, "On the
Parameterization and Initialization of Diagonal State Space Models", arXiv 2206.11893, §3: the diagonal SSM, its
discretisation and Vandermonde kernel; §4: the S4D-Lin initialisation): each of the 28 rows (28 features) is one
time step, as the GRU and the TCN read them (:class:`~gradsync.workloads.rnn.RowGRU`,
:class:`~gradsync.workloads.tcn.RowTCN`). A pointwise linear encoder to ``d_model`` channels, then residual blocks
``x + Mix(GELU(S4D(x)))``: per channel a diagonal SSM with ``A_n = -1/2 + i pi n``, a step ``dt`` drawn
log-uniformly from [1e-3, 1e-1], complex ``C ~ CN(0, 1)`` and a skip ``D``, discretised by zero-order hold; its
length-L kernel ``K_l = 2 Re(sum_n C'_n exp(dt A_n l))`` is applied as a causal convolution by
``torch.fft.rfft``/``irfft`` of length 2L; ``Mix`` a pointwise linear map of the channels. A linear head on the
mean over time. No normalisation (a LayerNorm needs the channels last, the FFTs time last: a pre-LayerNorm
version that transposed took about 10 % longer a step, for +0.5 points after one epoch in a one-process trial at
d_model 96) and no dropout; every parameter is a plain real fp32 tensor (``A`` and ``C`` are stored as their
real and imaginary parts), so the recipe's SGD and weight decay treat them like any other weight.

d_model 64, 64 complex modes (state size 128), 3 layers: a forward and backward pass plus the SGD step of batch
64 took a median of 46.7 ms on one thread here (the other core busy; 41.1 ms timed alternately with the TCN,
which took 37.7 ms in that run; d_model 96 with 32 modes: 55.1 ms, 128 with 32: 86.6 ms). About 10 ms of it are
the ~2,200 page faults per step of glibc handing the FFT buffers back to the system and taking them again
(39.1 ms with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` raised); at d_model 64 a batch's spectra
(64 x 64 x 29 complex) fit the 1 MiB L2 cache, wider models slow down more than their FLOPs.

64,522 parameters (258,088 bytes of fp32 gradients): three S4D layers of four 64 x 64 mode matrices (16,384
each: ``log(-Re A)``, ``Im A``, ``Re C``, ``Im C``) plus 64 ``log dt`` and 64 ``D``, three 64 x 64 channel
mixings (4,096 weights each, 1x1 convolutions), the 28 -> 64 encoder (1,792), 256 biases of the encoder and the
mixings, and the 650 of the head.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class _CausalFFTConv(torch.autograd.Function):
    """``y[b, h, l] = sum_{j <= l} k[h, l - j] u[b, h, j]`` by FFTs of length ``2L`` (no wrap-around).

    ``u`` ``[B, H, L]`` float32, ``k`` ``[H, L]`` float32 -> ``[B, H, L]`` float32. The backward pass is
    written out (a correlation with the same spectra) so that it runs real FFTs only; autograd's backward of
    ``rfft`` is a complex FFT of the full length.
    """

    @staticmethod
    def forward(ctx, u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        n = 2 * u.shape[-1]
        u_f = torch.fft.rfft(u, n=n)  # [B, H, L + 1]
        k_f = torch.fft.rfft(k, n=n)  # [H, L + 1]
        ctx.save_for_backward(u_f, k_f)
        return torch.fft.irfft(u_f * k_f, n=n)[..., :u.shape[-1]].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u_f, k_f = ctx.saved_tensors
        length = grad.shape[-1]
        g_f = torch.fft.rfft(grad, n=2 * length)
        grad_u = torch.fft.irfft(g_f * k_f.conj(), n=2 * length)[..., :length]
        # sum_b g_f conj(u_f) = conj(sum_b conj(g_f) u_f): in place on g_f, without a conjugated copy of u_f
        grad_k = torch.fft.irfft(g_f.conj_physical_().mul_(u_f).sum(0).conj(), n=2 * length)[..., :length]
        return grad_u, grad_k


class S4DKernel(nn.Module):
    """The S4D convolution of every channel: ``[B, H, L]`` float32 -> ``[B, H, L]`` float32, causal
    (output step ``l`` depends on input steps ``<= l`` only).

    Args:
        channels: channels H, one diagonal SSM each.
        modes: complex modes per channel (half the state size N of the real SSM: conjugate pairs).
        dt_min: smallest initial step.
        dt_max: largest initial step.

    Raises:
        ValueError: for ``channels`` or ``modes`` < 1, or not ``0 < dt_min <= dt_max``.
    """

    def __init__(self, channels: int, modes: int, dt_min: float = 1e-3, dt_max: float = 1e-1) -> None:
        super().__init__()
        if min(channels, modes) < 1 or not 0 < dt_min <= dt_max:
            raise ValueError(f"channels and modes must be >= 1 and 0 < dt_min <= dt_max; got channels={channels}, "
                             f"modes={modes}, dt_min={dt_min}, dt_max={dt_max}")
        self.log_dt = nn.Parameter(torch.rand(channels) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.log_a_real = nn.Parameter(torch.full((channels, modes), math.log(0.5)))  # Re A = -exp(.) = -1/2
        self.a_imag = nn.Parameter(math.pi * torch.arange(modes, dtype=torch.float32).repeat(channels, 1))
        self.c_real = nn.Parameter(torch.randn(channels, modes) * 0.5 ** 0.5)  # C ~ CN(0, 1)
        self.c_imag = nn.Parameter(torch.randn(channels, modes) * 0.5 ** 0.5)
        self.d = nn.Parameter(torch.randn(channels))

    def kernel(self, length: int) -> torch.Tensor:
        """The SSM's convolution kernel ``[H, length]`` float32, without ``D``, in real arithmetic and polar
        form: ``2 Re(C' exp(dt A l)) = 2 |C'| exp(dt Re(A) l) cos(dt Im(A) l + arg C')`` (two ``[H, N, L]``
        transcendental passes instead of three)."""
        dt = self.log_dt.exp().unsqueeze(-1)  # [H, 1]
        a_re, a_im = -self.log_a_real.exp(), self.a_imag  # [H, N]
        re, im = a_re * dt, a_im * dt  # dt A
        e = re.exp()  # zero-order hold: C' = C (exp(dt A) - 1) / A
        num_re, num_im = e * im.cos() - 1.0, e * im.sin()
        den = a_re.square() + a_im.square()
        q_re, q_im = (num_re * a_re + num_im * a_im) / den, (num_im * a_re - num_re * a_im) / den
        c_re = self.c_real * q_re - self.c_imag * q_im
        c_im = self.c_real * q_im + self.c_imag * q_re
        log_mag, angle = 0.5 * (c_re.square() + c_im.square()).log(), torch.atan2(c_im, c_re)
        steps = torch.arange(length, device=dt.device, dtype=torch.float32)
        modulus = torch.addcmul(log_mag.unsqueeze(-1), re.unsqueeze(-1), steps).exp()  # [H, N, L]
        return 2 * (modulus * torch.addcmul(angle.unsqueeze(-1), im.unsqueeze(-1), steps).cos()).sum(1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``u`` ``[B, H, L]`` -> ``[B, H, L]``; ``D u`` enters as the kernel's lag-0 term."""
        k = self.kernel(u.shape[-1])
        k = torch.cat([k[:, :1] + self.d.unsqueeze(-1), k[:, 1:]], 1)
        return _CausalFFTConv.apply(u, k)


class _S4DBlock(nn.Module):
    """``x + Mix(GELU(S4D(x)))`` on ``[B, H, L]`` float32; ``Mix`` a pointwise linear map of the channels (a
    1x1 convolution, so that no step transposes the activations)."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.ssm = S4DKernel(channels, modes)
        self.mix = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(F.gelu(self.ssm(x)))


class RowS4D(nn.Module):
    """``[B, 1, H, W]`` float32 images -> logits ``[B, classes]``; each of the H rows (W features) is one
    time step.

    Args:
        width: features per row (W).
        d_model: channels of every block.
        modes: complex modes of every channel's SSM.
        layers: residual S4D blocks.
        classes: output classes.

    Raises:
        ValueError: for ``width``, ``d_model``, ``modes``, ``layers`` or ``classes`` < 1.
    """

    def __init__(self, width: int = 28, d_model: int = 64, modes: int = 64, layers: int = 3,
                 classes: int = 10) -> None:
        super().__init__()
        if min(width, d_model, modes, layers, classes) < 1:
            raise ValueError(f"width, d_model, modes, layers and classes must be >= 1; got width={width}, "
                             f"d_model={d_model}, modes={modes}, layers={layers}, classes={classes}")
        self.encoder = nn.Conv1d(width, d_model, 1)  # pointwise: a linear map of each row
        self.blocks = nn.Sequential(*(_S4DBlock(d_model, modes) for _ in range(layers)))
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, 1, H, W]`` -> logits ``[B, classes]``."""
        return self.head(self.blocks(self.encoder(x.flatten(1, 2).transpose(1, 2))).mean(-1))
