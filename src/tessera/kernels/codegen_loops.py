"""IR -> C for any operator under a LoopSchedule: a plain loop nest.

Bounds come from the accesses, not from branches in the body: every guard 0 <= idx < size
of the output (and of every read when the body is a product, which is zero whenever a read
is out of bounds) is solved for the innermost loop it involves, whose range is clamped with
floor/ceil divisions of the outer loop variables. Reads of a body that is not a product
(a stencil's sum) keep an inline guard. The innermost loop gets ``omp simd`` (with a
``reduction`` when it runs over a reduced axis) and ``GCC unroll``; the outermost
``parallel`` loops are one collapsed OpenMP loop. Outputs are zeroed first, then
accumulated, as the IR's semantics say.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.kernels.ir import (
    Access,
    Affine,
    BinOp,
    Const,
    Expr,
    Operator,
    accesses,
    drop_unit_axes,
    is_product,
)
from tessera.kernels.schedule import LoopSchedule

HELPERS = """#include <string.h>
static inline long tk_fdiv(long a, long b) { long q = a / b; return (a % b != 0 && a < 0) ? q - 1 : q; }
static inline long tk_cdiv(long a, long b) { return -tk_fdiv(-a, b); }
static inline long tk_max(long a, long b) { return a > b ? a : b; }
static inline long tk_min(long a, long b) { return a < b ? a : b; }
"""


@dataclass(frozen=True)
class _Loop:
    name: str  # as in the schedule's order
    axis: str
    kind: str  # "full", "outer", "inner"


def _loops(op: Operator, s: LoopSchedule, unit: frozenset[str] = frozenset()) -> list[_Loop]:
    """The loops of ``s`` over ``op`` (unit axes dropped: loops naming an axis the operator
    does not have because its extent is 1 are skipped, so one schedule fits a batch of 1 too)."""
    names = {a.name for a in op.axes}
    tiled = s.tile_of
    out, seen = [], set()
    for entry in s.order:
        axis, _, part = entry.partition(".")
        if axis in unit:
            continue
        if axis not in names:
            raise ValueError(f"loop {entry!r} names no axis of {op.name} (axes: {', '.join(sorted(names))})")
        if part not in ("", "o", "i") or (part == "") == (axis in tiled):
            raise ValueError(f"loop {entry!r}: a tiled axis is split into .o and .i, an untiled one is named plainly")
        if entry in seen:
            raise ValueError(f"loop {entry!r} appears twice")
        seen.add(entry)
        out.append(_Loop(entry, axis, {"": "full", "o": "outer", "i": "inner"}[part]))
    missing = names - {lp.axis for lp in out}
    if missing:
        raise ValueError(f"the loop order misses axes {sorted(missing)} of {op.name}")
    return out


def unit_axes(op: Operator) -> frozenset[str]:
    return frozenset(a.name for a in op.axes if a.extent == 1)


def parallel_safe_axes(op: Operator) -> set[str]:
    """Axes whose distinct values write disjoint output elements (an output dimension indexed
    by that axis alone), so their iterations can run on different threads."""
    safe = set()
    for idx in op.output.index:
        if len(idx.coeffs) == 1:
            safe.add(idx.coeffs[0][0])
    return safe - set(op.reduction_axes)


class _Gen:
    def __init__(self, op: Operator, s: LoopSchedule):
        self.op, self.s = drop_unit_axes(op), s
        self.loops = _loops(self.op, s, unit_axes(op))
        self.extents = self.op.extents
        self.defining = {lp.axis: i for i, lp in enumerate(self.loops) if lp.kind != "outer"}
        self.inputs = [t.name for t in self.op.inputs]
        self.product = is_product(self.op.body)
        self.clamps: dict[int, list[tuple[Affine, int]]] = {}
        self.inline_guards: dict[int, list] = {}
        self._collect_guards()
        self._check_parallel()
        if s.vectorize and s.unroll > 1 and self.loops[-1].axis not in self.op.output.axes:
            raise ValueError("a vectorised reduction loop cannot also be unrolled (GCC: no pragma after omp simd)")

    def _collect_guards(self) -> None:
        clamped = [self.op.output] + (accesses(self.op.body) if self.product else [])
        for acc in clamped:
            for d in acc.guarded_dims(self.extents):
                idx = acc.index[d]
                at = max(self.defining[a] for a in idx.axes)
                self.clamps.setdefault(at, []).append((idx, acc.tensor.shape[d]))

    def _check_parallel(self) -> None:
        p = self.s.parallel
        safe = parallel_safe_axes(self.op)
        for i, lp in enumerate(self.loops[:p]):
            if lp.axis not in safe:
                raise ValueError(f"loop {lp.name!r} cannot run in parallel: axis {lp.axis!r} does not own its output elements")
            if lp.kind == "inner" or (i > 0 and i in self.clamps):
                raise ValueError(f"loop {lp.name!r} cannot be collapsed into the parallel loop (its bounds vary)")

    # ---- expressions ---------------------------------------------------------------------
    def access_c(self, acc: Access) -> str:
        if acc is self.op.output:
            return f"out[{acc.offset().c()}]"
        ref = f"in{self.inputs.index(acc.tensor.name)}[{acc.offset().c()}]"
        if self.product:
            return ref
        conds = [f"(unsigned long){acc.index[d].c()} < {acc.tensor.shape[d]}UL" for d in acc.guarded_dims(self.extents)]
        return f"(({' && '.join(conds)}) ? {ref} : 0.0f)" if conds else ref

    def expr_c(self, e: Expr) -> str:
        if isinstance(e, Access):
            return self.access_c(e)
        if isinstance(e, Const):
            return f"{float(e.value)!r}f"
        assert isinstance(e, BinOp)
        return f"({self.expr_c(e.lhs)} {e.op} {self.expr_c(e.rhs)})"

    # ---- loops ---------------------------------------------------------------------------
    def bounds(self, i: int, lp: _Loop) -> tuple[str, str]:
        e, t = self.extents[lp.axis], self.s.tile_of.get(lp.axis)
        if lp.kind == "inner":
            lo, hi = f"{lp.axis}_o", f"tk_min({lp.axis}_o + {t}, {e})"
        else:
            lo, hi = "0", str(e)
        for idx, size in self.clamps.get(i, []):
            c = idx.coeff(lp.axis)
            rest = (idx - Affine(((lp.axis, c),))).c()
            if c > 0:
                lo, hi = f"tk_max({lo}, tk_cdiv(-{rest}, {c}))", f"tk_min({hi}, tk_fdiv({size - 1} - {rest}, {c}) + 1)"
            else:
                lo = f"tk_max({lo}, tk_cdiv({rest} - {size - 1}, {-c}))"
                hi = f"tk_min({hi}, tk_fdiv({rest}, {-c}) + 1)"
        return lo, hi

    def header(self, i: int, lp: _Loop) -> str:
        """The loop's bounds (computed once, before it) and its ``for``."""
        v = lp.axis
        if lp.kind == "outer":
            return f"for (long {v}_o = 0; {v}_o < {self.extents[v]}; {v}_o += {self.s.tile_of[v]})"
        lo, hi = self.bounds(i, lp)
        if i < self.s.parallel:
            return f"for (long {v} = {lo}; {v} < {hi}; ++{v})"
        return f"const long {v}_lo = {lo}, {v}_hi = {hi};\n"

    def for_stmt(self, lp: _Loop) -> str:
        return f"for (long {lp.axis} = {lp.axis}_lo; {lp.axis} < {lp.axis}_hi; ++{lp.axis})"

    def open_loop(self, i: int, lp: _Loop) -> str:
        head = self.header(i, lp)
        if lp.kind == "outer" or i < self.s.parallel:
            return head + " {"
        return head + self.for_stmt(lp) + " {"

    def nest(self) -> str:
        s, last = self.s, len(self.loops) - 1
        inner = self.loops[last]
        if inner.kind == "outer":
            raise ValueError(f"the innermost loop {inner.name!r} must not be a block loop")
        if s.parallel > last:
            raise ValueError("the innermost loop cannot be a parallel loop")
        reduce_inner = inner.axis not in self.op.output.axes
        lines = []
        if s.parallel:
            collapse = f" collapse({s.parallel})" if s.parallel > 1 else ""
            lines.append(f"#pragma omp parallel for{collapse} num_threads(nthreads) schedule(static)")
        for i, lp in enumerate(self.loops[:last]):
            lines.append(self.open_loop(i, lp))
        body = self.expr_c(self.op.body)
        target = self.access_c(self.op.output)
        lines.append(self.header(last, inner))
        if reduce_inner:
            lines.append("float acc = 0.0f;")
        # GCC takes no other pragma between `omp simd` and its loop, so an unrolled vector
        # loop is `GCC ivdep` + `GCC unroll` (restrict pointers: no dependence to prove);
        # a vectorised reduction needs `omp simd reduction` (IEEE sums are not reassociated
        # otherwise) and is not unrolled (the constructor refuses that schedule).
        if s.vectorize and reduce_inner:
            lines.append("#pragma omp simd reduction(+:acc)")
        elif s.vectorize:
            lines.append("#pragma GCC ivdep")
        if s.unroll > 1:
            lines.append(f"#pragma GCC unroll {s.unroll}")
        stmt = f"acc += {body};" if reduce_inner else f"{target} += {body};"
        lines.append(f"{self.for_stmt(inner)} {{ {stmt} }}")
        if reduce_inner:
            lines.append(f"{target} += acc;")
        lines.append("}" * last)
        return "\n".join(lines)

    def source(self) -> str:
        params = ", ".join(["float *restrict out"] + [f"const float *restrict in{i}" for i in range(len(self.inputs))])
        numel = self.op.output.tensor.numel
        return "\n".join([
            f"/* {self.op.signature()}\n * schedule: {self.s.short()} */",
            HELPERS,
            "void tk_init(void) {}",
            f"void tk_run({params}, int nthreads) {{",
            "  (void)nthreads;",
            f"  memset(out, 0, {numel}UL * sizeof(float));",
            self.nest(),
            "}",
        ]) + "\n"


def generate_loops(op: Operator, schedule: LoopSchedule) -> str:
    """C source of ``op`` as a loop nest under ``schedule``."""
    return _Gen(op, schedule).source()


def default_loop_schedule(op: Operator, *, isa: str = "avx2", threads: int = 1) -> LoopSchedule:
    """The axes in declaration order, output axes first, parallel over the first safe one."""
    op = drop_unit_axes(op)
    out_axes = [a.name for a in op.axes if a.name in op.output.axes]
    order = tuple(out_axes[:-1] + list(op.reduction_axes) + out_axes[-1:])
    safe = parallel_safe_axes(op)
    parallel = 1 if order and order[0] in safe and threads > 1 else 0
    return LoopSchedule(order=order, parallel=parallel, isa=isa)
