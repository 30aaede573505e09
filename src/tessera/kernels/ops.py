"""The operators Tessera compiles, written in the IR: GEMM (any transposition), batched
GEMM, conv2d forward (stride, padding, groups, depthwise) and the operators of its
backward pass (weight gradient, the column gradient and col2im of the data gradient).

Tensors are described in the shapes the kernels see. A grouped conv sees its NCHW input
as [N, G, C/G, H, W] and its weight [C_out, C_in/G, KH, KW] as [G, C_out/G, C_in/G, KH, KW]:
the same row-major memory, with the group as an axis of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.kernels.ir import Axis, Operator, Tensor


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def gemm(m: int, n: int, k: int, *, trans_a: bool = False, trans_b: bool = False) -> Operator:
    """C[m, n] = sum_k A(m, k) B(k, n); A is stored [k, m] when trans_a, B [n, k] when trans_b."""
    return batched_gemm(1, m, n, k, trans_a=trans_a, trans_b=trans_b)


def batched_gemm(
    batch: int, m: int, n: int, k: int, *, trans_a: bool = False, trans_b: bool = False
) -> Operator:
    for name, value in (("batch", batch), ("m", m), ("n", n), ("k", k)):
        _positive(name, value)
    b_, m_, n_, k_ = Axis("b", batch), Axis("m", m), Axis("n", n), Axis("k", k)
    lead = (batch,) if batch > 1 else ()
    A = Tensor("A", lead + ((k, m) if trans_a else (m, k)))
    B = Tensor("B", lead + ((n, k) if trans_b else (k, n)))
    C = Tensor("C", lead + (m, n))
    bi = (b_,) if batch > 1 else ()
    a = A[bi + ((k_, m_) if trans_a else (m_, k_))]
    b = B[bi + ((n_, k_) if trans_b else (k_, n_))]
    name = ("bmm" if batch > 1 else "gemm") + ("_" + ("t" if trans_a else "n") + ("t" if trans_b else "n"))
    axes = ((b_,) if batch > 1 else ()) + (m_, n_, k_)
    return Operator(name=name, axes=axes, output=C[bi + (m_, n_)], body=a * b)


@dataclass(frozen=True, kw_only=True)
class Conv2dShape:
    """A 2-D convolution's sizes (NCHW input, [C_out, C_in/groups, KH, KW] weight)."""

    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    groups: int = 1

    def __post_init__(self):
        for name in ("batch", "in_channels", "out_channels", "height", "width", "groups"):
            _positive(name, getattr(self, name))
        for name in ("kernel", "stride"):
            pair = getattr(self, name)
            if len(pair) != 2:
                raise ValueError(f"{name} must be a pair (h, w), got {pair!r}")
            for v in pair:
                _positive(name, v)
        if len(self.padding) != 2 or any(not isinstance(p, int) or p < 0 for p in self.padding):
            raise ValueError(f"padding must be a pair of ints >= 0, got {self.padding!r}")
        for name in ("in_channels", "out_channels"):
            if getattr(self, name) % self.groups:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by groups={self.groups}")
        if self.out_height < 1 or self.out_width < 1:
            raise ValueError(
                f"kernel {self.kernel} with padding {self.padding} does not fit the {self.height}x{self.width} input"
            )

    @property
    def out_height(self) -> int:
        return (self.height + 2 * self.padding[0] - self.kernel[0]) // self.stride[0] + 1

    @property
    def out_width(self) -> int:
        return (self.width + 2 * self.padding[1] - self.kernel[1]) // self.stride[1] + 1

    @property
    def depthwise(self) -> bool:
        return self.groups == self.in_channels == self.out_channels

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.in_channels, self.height, self.width)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.out_channels, self.in_channels // self.groups, *self.kernel)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.out_channels, self.out_height, self.out_width)

    @property
    def flops(self) -> int:
        per_out = 2 * (self.in_channels // self.groups) * self.kernel[0] * self.kernel[1]
        return per_out * self.batch * self.out_channels * self.out_height * self.out_width

    def label(self) -> str:
        s = f"n{self.batch} c{self.in_channels}->{self.out_channels} {self.height}x{self.width} k{self.kernel[0]}x{self.kernel[1]}"
        s += f" s{self.stride[0]}" + (f" p{self.padding[0]}" if any(self.padding) else "")
        return s + (f" g{self.groups}" if self.groups > 1 else "")


def _conv_parts(s: Conv2dShape):
    g, cig, cog = s.groups, s.in_channels // s.groups, s.out_channels // s.groups
    ax = {
        "n": Axis("n", s.batch),
        "g": Axis("g", g),
        "co": Axis("co", cog),
        "oh": Axis("oh", s.out_height),
        "ow": Axis("ow", s.out_width),
        "ci": Axis("ci", cig),
        "r": Axis("r", s.kernel[0]),
        "s": Axis("s", s.kernel[1]),
    }
    X = Tensor("X", (s.batch, g, cig, s.height, s.width))
    W = Tensor("W", (g, cog, cig, *s.kernel))
    Y = Tensor("Y", (s.batch, g, cog, s.out_height, s.out_width))
    ih = ax["oh"] * s.stride[0] + ax["r"] - s.padding[0]
    iw = ax["ow"] * s.stride[1] + ax["s"] - s.padding[1]
    return ax, X, W, Y, ih, iw


def conv2d(s: Conv2dShape) -> Operator:
    """Y[n, g, co, oh, ow] = sum_{ci, r, s} W[g, co, ci, r, s] X[n, g, ci, oh*sh + r - ph, ow*sw + s - pw]."""
    ax, X, W, Y, ih, iw = _conv_parts(s)
    n, g, co, oh, ow, ci, r, s_ = (ax[k] for k in ("n", "g", "co", "oh", "ow", "ci", "r", "s"))
    return Operator(
        name="conv2d",
        axes=(n, g, co, oh, ow, ci, r, s_),
        output=Y[n, g, co, oh, ow],
        body=W[g, co, ci, r, s_] * X[n, g, ci, ih, iw],
    )


def conv2d_weight_grad(s: Conv2dShape) -> Operator:
    """dW[g, co, ci, r, s] = sum_{n, oh, ow} dY[n, g, co, oh, ow] X[n, g, ci, ih, iw]."""
    ax, X, W, Y, ih, iw = _conv_parts(s)
    dW, dY = Tensor("dW", W.shape), Tensor("dY", Y.shape)
    n, g, co, oh, ow, ci, r, s_ = (ax[k] for k in ("n", "g", "co", "oh", "ow", "ci", "r", "s"))
    return Operator(
        name="conv2d_wgrad",
        axes=(g, co, ci, r, s_, n, oh, ow),
        output=dW[g, co, ci, r, s_],
        body=dY[n, g, co, oh, ow] * X[n, g, ci, ih, iw],
    )


def conv2d_column_grad(s: Conv2dShape) -> Operator:
    """The data gradient's GEMM: dCol[n, g, ci, r, s, oh, ow] = sum_co W[g, co, ci, r, s] dY[n, g, co, oh, ow]."""
    ax, X, W, Y, ih, iw = _conv_parts(s)
    dY = Tensor("dY", Y.shape)
    dCol = Tensor("dCol", (s.batch, s.groups, s.in_channels // s.groups, *s.kernel, s.out_height, s.out_width))
    n, g, co, oh, ow, ci, r, s_ = (ax[k] for k in ("n", "g", "co", "oh", "ow", "ci", "r", "s"))
    return Operator(
        name="conv2d_colgrad",
        axes=(n, g, ci, r, s_, oh, ow, co),
        output=dCol[n, g, ci, r, s_, oh, ow],
        body=W[g, co, ci, r, s_] * dY[n, g, co, oh, ow],
    )


def col2im(s: Conv2dShape) -> Operator:
    """dX[n, g, ci, oh*sh + r - ph, ow*sw + s - pw] += dCol[n, g, ci, r, s, oh, ow] (a scatter-add)."""
    ax, X, W, Y, ih, iw = _conv_parts(s)
    dX = Tensor("dX", X.shape)
    dCol = Tensor("dCol", (s.batch, s.groups, s.in_channels // s.groups, *s.kernel, s.out_height, s.out_width))
    n, g, oh, ow, ci, r, s_ = (ax[k] for k in ("n", "g", "oh", "ow", "ci", "r", "s"))
    return Operator(
        name="col2im",
        axes=(n, g, ci, r, s_, oh, ow),
        output=dX[n, g, ci, ih, iw],
        body=dCol[n, g, ci, r, s_, oh, ow],
    )


def conv2d_data_grad_direct(s: Conv2dShape) -> Operator:
    """dX[n, g, ci, ih, iw] += W[g, co, ci, r, s] dY[n, g, co, oh, ow] in one scatter (depthwise uses it)."""
    ax, X, W, Y, ih, iw = _conv_parts(s)
    dX, dY = Tensor("dX", X.shape), Tensor("dY", Y.shape)
    n, g, co, oh, ow, ci, r, s_ = (ax[k] for k in ("n", "g", "co", "oh", "ow", "ci", "r", "s"))
    return Operator(
        name="conv2d_dgrad",
        axes=(n, g, ci, co, r, s_, oh, ow),
        output=dX[n, g, ci, ih, iw],
        body=W[g, co, ci, r, s_] * dY[n, g, co, oh, ow],
    )
