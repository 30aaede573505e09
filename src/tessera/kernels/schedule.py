"""Schedules as data: how an operator's loop nest is cut, ordered, packed, unrolled and
spread over threads. Two kinds, one per code generator:

``GemmSchedule`` lowers a contraction onto the micro-kernel (BLIS's five loops): register
tile MR x NR, cache tiles MC / NC / KC, the order of the three outer loops and of the two
inner ones, packing of each operand, the k-loop unroll, which loop runs on OpenMP threads,
and, for a B read in place, how many rows ahead the micro-kernel prefetches it, or, for a
packed B, whether each panel is packed by its first row tile while it computes.

``LoopSchedule`` lowers any operator as a plain loop nest: tiles per axis, the loop order,
the (collapsed) parallel outer loops, ``omp simd`` on the innermost loop and its unroll.
Issue 14's stencils are loop nests of this kind.

``DirectSchedule`` lowers the operators that have a kernel of their own (``direct``): a
depthwise convolution (a padded plane per thread, output rows blocked in registers) and a
matrix-vector product (GEMV, rows of the matrix streamed once); its two knobs are the
register block (rows x vectors).

A schedule never changes results: reductions always run in one fixed order inside one
thread, so the same binary gives bit-identical outputs at any thread count.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

# vector ISA -> (floats per register, vector registers, compiler flags beyond the common ones)
ISAS: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "avx2": (8, 16, ("-mavx2", "-mfma")),
    "avx512": (16, 32, ("-mavx2", "-mfma", "-mavx512f")),
}
# the register tiles (MR, NR) the space offers per ISA (each fits the ISA's vector registers)
REGISTER_TILES = {
    "avx2": ((6, 16), (4, 24), (8, 8), (4, 16), (12, 8), (5, 16)),
    "avx512": ((14, 32), (12, 32), (8, 32), (6, 64), (28, 16), (4, 48), (8, 48)),
}
GEMM_PARALLEL = ("none", "batch", "jc", "ic", "jr", "ir")
OUTER_ORDERS = ("jc,pc,ic", "ic,pc,jc")
INNER_ORDERS = ("jr,ir", "ir,jr")


def _isa(isa: str) -> tuple[int, int, tuple[str, ...]]:
    if isa not in ISAS:
        raise ValueError(f"unknown vector ISA {isa!r}; choose one of {', '.join(ISAS)}")
    return ISAS[isa]


@dataclass(frozen=True, kw_only=True)
class GemmSchedule:
    isa: str = "avx2"
    mr: int = 6
    nr: int = 16
    mc: int = 96
    nc: int = 1024
    kc: int = 256
    order: str = "jc,pc,ic"
    inner: str = "jr,ir"
    pack_a: bool = True
    pack_b: bool = True
    unroll: int = 4
    parallel: str = "ic"
    fuse_n: bool = True  # a conv's images join N (one wide GEMM) instead of a batch loop
    prefetch_b: int = 0  # rows of B ahead the micro-kernel fetches when it reads B in place (0: none)
    pack_b_first_tile: bool = False  # each B panel packed by its first row tile while it computes
    prefetch_next_b: bool = False  # the next B panel's rows fetched from B's matrix during this panel's tiles
    kind: str = field(default="gemm", init=False)

    def __post_init__(self):
        vl, regs, _ = _isa(self.isa)
        if self.nr < vl or self.nr % vl:
            raise ValueError(f"nr={self.nr} must be a multiple of the {self.isa} vector length {vl}")
        live = self.mr * (self.nr // vl) + self.nr // vl + 1
        if self.mr < 1 or live > regs:
            raise ValueError(
                f"register tile {self.mr}x{self.nr} needs {live} vector registers; {self.isa} has {regs}"
            )
        for name, tile, unit in (("mc", self.mc, self.mr), ("nc", self.nc, self.nr)):
            if tile < unit or tile % unit:
                raise ValueError(f"{name}={tile} must be a positive multiple of {unit}")
        if self.kc < 1 or self.unroll < 1:
            raise ValueError(f"kc={self.kc} and unroll={self.unroll} must be >= 1")
        if self.order not in OUTER_ORDERS or self.inner not in INNER_ORDERS:
            raise ValueError(f"loop order {self.order!r}/{self.inner!r}; choose from {OUTER_ORDERS} / {INNER_ORDERS}")
        if self.parallel not in GEMM_PARALLEL:
            raise ValueError(f"parallel loop {self.parallel!r}; choose one of {', '.join(GEMM_PARALLEL)}")
        if not isinstance(self.prefetch_b, int) or self.prefetch_b < 0:
            raise ValueError(f"prefetch_b={self.prefetch_b!r} must be an int >= 0 (rows of B ahead; 0: none)")
        if self.pack_b_first_tile and not self.pack_b:
            raise ValueError("pack_b_first_tile=True packs B panel by panel; it needs pack_b=True")
        if self.prefetch_b and self.pack_b:
            raise ValueError(f"prefetch_b={self.prefetch_b} applies to B read in place; use pack_b=False or prefetch_b=0")
        if self.prefetch_next_b and self.pack_b and not self.pack_b_first_tile:
            raise ValueError("prefetch_next_b=True fetches B's next panel from its matrix; it needs B read in place "
                             "(pack_b=False) or packed by each panel's first tile (pack_b_first_tile=True)")
        if self.prefetch_next_b and self.inner != "jr,ir":
            raise ValueError(f"prefetch_next_b=True needs inner='jr,ir' (a B panel held across the row tiles), not {self.inner!r}")

    def packing_b(self, *, first_tile: bool | None = None) -> GemmSchedule:
        """This schedule with B packed: no rows of B prefetched in place, each panel packed by
        its first row tile when ``first_tile`` (None: as it is), and the next panel's fetch from
        B's matrix (``prefetch_next_b``) kept only where a panel is still read from it, i.e.
        packed by its first tile (the rule ``__post_init__`` checks)."""
        first = self.pack_b_first_tile if first_tile is None else first_tile
        return replace(self, pack_b=True, prefetch_b=0, pack_b_first_tile=first,
                       prefetch_next_b=self.prefetch_next_b and first)

    @property
    def vector_length(self) -> int:
        return ISAS[self.isa][0]

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def short(self) -> str:
        packs = ("A" if self.pack_a else "") + ("B" if self.pack_b else "")
        return (
            f"{self.isa} {self.mr}x{self.nr} mc{self.mc} nc{self.nc} kc{self.kc} {self.order}|{self.inner}"
            f" pack{packs or '-'} u{self.unroll} par:{self.parallel}" + ("" if self.fuse_n else " batch-loop")
            + (f" pfb{self.prefetch_b}" if self.prefetch_b else "") + (" pb1st" if self.pack_b_first_tile else "")
            + (" pfnb" if self.prefetch_next_b else "")
        )


@dataclass(frozen=True, kw_only=True)
class LoopSchedule:
    """``order`` names every loop: an untiled axis by its name, a tiled one as ``axis.o``
    (its blocks, which must come first) and ``axis.i`` (inside a block of ``tiles[axis]``)."""

    order: tuple[str, ...]
    tiles: tuple[tuple[str, int], ...] = ()
    parallel: int = 0  # how many outermost loops are collapsed into one parallel loop
    vectorize: bool = True
    unroll: int = 1
    isa: str = "avx2"
    kind: str = field(default="loops", init=False)

    def __post_init__(self):
        _isa(self.isa)
        if self.parallel < 0 or self.parallel > len(self.order):
            raise ValueError(f"parallel={self.parallel} must name 0..{len(self.order)} outer loops")
        if self.unroll < 1:
            raise ValueError(f"unroll={self.unroll} must be >= 1")
        for axis, size in self.tiles:
            if size < 1:
                raise ValueError(f"tile of axis {axis!r} is {size}; it must be >= 1")
            if f"{axis}.o" not in self.order or f"{axis}.i" not in self.order:
                raise ValueError(f"tiled axis {axis!r} needs loops {axis}.o and {axis}.i in the order")
            if self.order.index(f"{axis}.o") > self.order.index(f"{axis}.i"):
                raise ValueError(f"loop {axis}.o must come before {axis}.i")

    @property
    def tile_of(self) -> dict[str, int]:
        return dict(self.tiles)

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def short(self) -> str:
        tiles = ",".join(f"{a}:{t}" for a, t in self.tiles)
        return f"loops {'>'.join(self.order)} tiles[{tiles}] par{self.parallel} simd{int(self.vectorize)} u{self.unroll}"


DIRECT_ALGOS = ("depthwise", "grouped", "gemv", "flat", "flatc", "flatcl", "dwc", "amx")


@dataclass(frozen=True, kw_only=True)
class DirectSchedule:
    """``algo``: the specialised kernel; ``rows`` x ``vecs``: its register block (depthwise:
    output rows x vectors along a row; GEMV: matrix rows per pass x vectors of the output),
    for ``amx`` (a GEMM on AMX tiles, avx512 only) its cache blocks instead: rows of A a block
    x columns of K a block."""

    algo: str
    isa: str = "avx2"
    rows: int = 1
    vecs: int = 2
    kind: str = field(default="direct", init=False)

    def __post_init__(self):
        _, regs, _ = _isa(self.isa)
        if self.algo not in DIRECT_ALGOS:
            raise ValueError(f"direct kernel {self.algo!r}; choose one of {', '.join(DIRECT_ALGOS)}")
        if self.rows < 1 or self.vecs < 1:
            raise ValueError(f"register block {self.rows}x{self.vecs} must be at least 1x1")
        if self.algo == "amx":
            if self.isa != "avx512" or self.rows % 32 or self.vecs % 32:
                raise ValueError(f"amx kernel: isa avx512 and blocks in multiples of 32, got {self.isa} "
                                 f"{self.rows} rows x {self.vecs} of K")
            return
        live = self.rows * self.vecs + self.vecs + 1 if self.algo != "gemv" else self.vecs + 2
        if live > regs:
            raise ValueError(f"register block {self.rows}x{self.vecs} needs {live} vector registers; {self.isa} has {regs}")

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def short(self) -> str:
        if self.algo == "amx":
            return f"amx bf16x6 mb{self.rows} kc{self.vecs}"
        return f"{self.algo} {self.isa} {self.rows}x{self.vecs}"


WINOGRAD_TILES = (2, 4)


@dataclass(frozen=True, kw_only=True)
class WinogradSchedule:
    """A 3x3 stride-1 convolution as Winograd F(m x m, 3 x 3): transforms in ``isa`` around
    (m + 2)^2 GEMMs run under ``gemm``."""

    m: int = 4
    isa: str = "avx2"
    gemm: GemmSchedule = field(default_factory=GemmSchedule)
    kind: str = field(default="winograd", init=False)

    def __post_init__(self):
        _isa(self.isa)
        if self.m not in WINOGRAD_TILES:
            raise ValueError(f"Winograd output tile m={self.m}; choose one of {WINOGRAD_TILES}")
        if not isinstance(self.gemm, GemmSchedule):
            raise ValueError(f"a Winograd schedule's gemm must be a GemmSchedule, not {self.gemm!r}")

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def short(self) -> str:
        return f"winograd F({self.m}x{self.m},3x3) {self.isa} gemm[{self.gemm.short()}]"


Schedule = GemmSchedule | LoopSchedule | DirectSchedule | WinogradSchedule


def schedule_from_dict(data: dict) -> Schedule:
    data = dict(data)
    kind = data.pop("kind", "gemm")
    if kind == "gemm":
        return GemmSchedule(**data)
    if kind == "direct":
        return DirectSchedule(**data)
    if kind == "winograd":
        return WinogradSchedule(**(data | {"gemm": schedule_from_dict(data["gemm"])}))
    data["order"] = tuple(data["order"])
    data["tiles"] = tuple(tuple(t) for t in data.get("tiles", ()))
    return LoopSchedule(**data)
