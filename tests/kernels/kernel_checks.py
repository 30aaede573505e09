"""Checks shared by the kernels tests: random inputs, the float32 error bound and a weight packed once."""

import numpy as np

from tessera.kernels import reference
from tessera.kernels.ir import Operator

UNIT_ROUNDOFF = 2.0**-24  # u for float32 (half of machine epsilon)


def random_inputs(op: Operator, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}


def error_bound(op: Operator, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The standard bound of a float32 sum of products, per output element:

        |computed - exact| <= gamma(2n) * sum_i |a_i b_i|,   gamma(j) = j u / (1 - j u)

    with n the element's number of terms (its reduction length, counted with padding taken
    out). An FMA chain rounds once per term (n); the micro-kernel adds each k block's partial
    sum to C once more (at most n further roundings), hence 2n. Exact zeros stay exact."""
    ones = {k: np.ones_like(v) for k, v in inputs.items()}
    n = reference.evaluate(op, ones).max()
    j = 2 * max(1.0, n)
    return j * UNIT_ROUNDOFF / (1 - j * UNIT_ROUNDOFF) * reference.magnitude(op, inputs)


def assert_within_bound(out: np.ndarray, op: Operator, inputs: dict[str, np.ndarray]) -> None:
    exact = reference.evaluate(op, inputs)
    err = np.abs(out.astype(np.float64).reshape(exact.shape) - exact)
    bound = error_bound(op, inputs)
    worst = np.max(err - bound)
    assert worst <= 0, f"{op.name}: error exceeds the bound by {worst:.3g} (max err {err.max():.3g})"


def run(kernel, op: Operator, inputs: dict[str, np.ndarray], threads: int = 1) -> np.ndarray:
    return kernel(*[inputs[t.name] for t in op.inputs], threads=threads)


def assert_prepacked_weight_agrees(kernel, op: Operator, inputs: dict[str, np.ndarray], want: np.ndarray) -> None:
    """The weight (input 0) packed once at bind gives ``want`` bit for bit (the same sums in the
    same order), and the bound call no longer reads the array it was bound with."""
    args = [inputs[t.name].copy() for t in op.inputs]
    call, out = kernel.bind(*args, threads=2, constant=0)
    call()
    np.testing.assert_array_equal(out, want)
    args[0][:] = 0.0
    call()
    np.testing.assert_array_equal(out, want)
