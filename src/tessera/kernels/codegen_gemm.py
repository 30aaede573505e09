"""IR -> C for a contraction under a GemmSchedule: offset tables from the affine accesses,
then BLIS's loops around the micro-kernel of ``csrc/tessera_primitives.h``.

The generated file defines ``tk_init()`` (fills the tables; called once when loaded) and
``tk_run(out, in0, in1, nthreads)``, inputs in the operator's order. All sizes are
compile-time constants. A block packed outside the parallel loop is shared and packed by
all threads together (one panel each, then a barrier); one packed inside it is private. The
parallel loop itself ends without a barrier: a thread owns the same C tiles in every pass
(static schedule, the same trip count for the same block), so it may run ahead into the
next pass; only a shared block's repacking waits for every thread (a barrier before it).

For an operand that is a constant (a layer's weight) and can be packed whole (packed by the
schedule, no batch, no zero padding), a second source (``prepacked="A"`` or ``"B"``) defines
``tk_prepack(in, dst)``, which packs all of it once in the order the blocks are used (k block
by k block, each a run of micro-panels: block (pc, jc) of B starts at ``pc * NP + jc * kc``),
``tk_prepacked_floats`` its size, and ``tk_run_prepacked(out, in0, in1, packed, nthreads)``,
the same loops reading the packed operand in place of packing it: what MKL's packed SGEMM
and oneDNN's reordered weights do.
"""

from __future__ import annotations

from tessera.kernels.contraction import Contraction, analyse
from tessera.kernels.ir import Affine
from tessera.kernels.schedule import GemmSchedule

LEVELS = {"jc,pc,ic": ("jc", "pc", "ic"), "ic,pc,jc": ("ic", "pc", "jc")}


def _table(name: str, ctype: str, axes, expr: Affine) -> tuple[str, str]:
    """A static table over the flattened axes and the C loop nest that fills it."""
    size = 1
    for ax in axes:
        size *= ax.extent
    decl = f"static {ctype} {name}[{size}];"
    loops = "".join(f"for (long {ax.name} = 0; {ax.name} < {ax.extent}; ++{ax.name}) " for ax in axes)
    fill = f"  {{ long at = 0; {loops}{name}[at++] = {expr.c()}; }}"
    return decl, fill


class _Gen:
    def __init__(self, con: Contraction, s: GemmSchedule):
        self.c, self.s = con, s
        self.BT, self.M, self.N, self.K = con.sizes
        self.out = con.op.output
        self.guards = con.b.guarded_dims(con.op.extents)
        self.decls: list[str] = []
        self.fills: list[str] = []
        self.a_scale = (con.scaled_flat(con.part(con.a, "m"), "m"), con.scaled_flat(con.part(con.a, "k"), "k"))
        self.b_rs = con.scaled_flat(con.part(con.b, "k"), "k")
        self.b_rows = con.scaled_flat(con.part(con.b, "n"), "n") == 1 and not self.guards
        self.c_cols = con.scaled_flat(con.part(self.out, "n"), "n") == 1
        self.panels = -(-self.N // s.nr)
        self.pack_a = s.pack_a or None in self.a_scale
        self.pack_b = s.pack_b or not (self.b_rows and self.b_rs is not None)
        self.prepacked: str | None = None  # "A" or "B" while the prepacked run is generated
        self.fuse_b = False  # B packed by each panel's first tile (set by loops())

    def arg(self, tensor) -> str:
        """The C argument (``in0``, ``in1``) that passes ``tensor``, an input of the operator."""
        return f"in{[t.name for t in self.c.op.inputs].index(tensor.name)}"

    def prepackable(self, which: str) -> bool:
        """Can a prepacked run take operand ``which`` ("A" or "B") whole: packed by the
        schedule, no batch, and (B) no zero padding to check."""
        if self.BT != 1:
            return False
        return self.pack_a if which == "A" else (self.pack_b and not self.guards)

    def add(self, name: str, ctype: str, group: str, expr: Affine) -> None:
        decl, fill = _table(name, ctype, getattr(self.c, group), expr)
        self.decls.append(decl)
        self.fills.append(fill)

    def tables(self) -> None:
        c = self.c
        for tag, acc in (("a", c.a), ("b", c.b), ("c", self.out)):
            self.add(f"{tag}_bt", "long", "batch", c.part(acc, "batch", const=True))
        self.add("a_m", "long", "m", c.part(c.a, "m"))
        self.add("c_m", "long", "m", c.part(self.out, "m"))
        self.add("b_n", "long", "n", c.part(c.b, "n"))
        self.add("c_n", "long", "n", c.part(self.out, "n"))
        self.add("a_k", "long", "k", c.part(c.a, "k"))
        self.add("b_k", "long", "k", c.part(c.b, "k"))
        for g, dim in enumerate(self.guards):
            self.add(f"g{g}_bt", "int", "batch", c.index_part(c.b, dim, "batch", const=True))
            self.add(f"g{g}_n", "int", "n", c.index_part(c.b, dim, "n"))
            self.add(f"g{g}_k", "int", "k", c.index_part(c.b, dim, "k"))
        panels = self.panels
        self.decls.append(f"static long pstep[{panels}];")
        self.decls.append(f"static unsigned char cpanel[{panels}];")  # NR-panel p of C is contiguous
        checks = " ".join(
            f"if (g{g}_n[nb + j] != g{g}_n[nb] + j * (g{g}_n[nb + 1] - g{g}_n[nb])) step = 0;"
            for g in range(len(self.guards))
        )
        self.fills.append(
            f"  for (long p = 0; p < {panels}; ++p) {{ long nb = p * TK_NR, step = 0;\n"
            f"    if (nb + TK_NR <= {self.N}) {{ step = b_n[nb + 1] - b_n[nb];\n"
            f"      for (long j = 0; j < TK_NR; ++j) {{ if (b_n[nb + j] != b_n[nb] + j * step) step = 0; {checks} }} }}\n"
            f"    pstep[p] = step; }}"
        )
        self.fills.append(self._runs_fill(panels))
        self.fills.append(
            f"  for (long p = 0; p < {panels}; ++p) {{ long nb = p * TK_NR, ok = 1;\n"
            f"    for (long j = 1; j < TK_NR && nb + j < {self.N}; ++j) if (c_n[nb + j] != c_n[nb] + j) ok = 0;\n"
            f"    cpanel[p] = ok; }}"
        )

    def _runs_fill(self, panels: int) -> str:
        """C filling ``pruns``: each panel's columns cut into maximal runs (offsets stepping
        by one constant from 1 to 255, each guard's index by a constant from 0 to 255); a
        column that starts no such step is a run of one (its guards checked as constants)."""
        self.decls.append(f"static tk_runs pruns[{panels}];")
        ng = len(self.guards)
        slopes = " ".join(
            f"{{ long d = g{q}_n[n + 1] - g{q}_n[n]; if (d < 0 || d > 255) ok = 0; sl[{q}] = d; }}"
            for q in range(ng)
        )
        same = " ".join(f"if (g{q}_n[n + 1] - g{q}_n[n] != sl[{q}]) break;" for q in range(ng))
        return (
            f"  for (long p = 0; p < {panels}; ++p) {{ long nb = p * TK_NR, cols = tk_min(TK_NR, {self.N} - nb), j = 0;"
            " tk_runs *r = pruns + p; r->count = 0;\n"
            "    while (j < cols) { long n = nb + j, len = 1, st = 0, ok = 0, sl[4] = {0, 0, 0, 0};\n"
            "      if (j + 1 < cols) { st = b_n[n + 1] - b_n[n]; ok = st >= 1 && st <= 255; }\n"
            f"      if (ok) {{ {slopes} }}\n"
            "      if (!ok) { st = 1; sl[0] = sl[1] = sl[2] = sl[3] = 0; }\n"
            "      else for (len = 1; j + len < cols; ++len) { n = nb + j + len - 1;"
            f" if (b_n[n + 1] - b_n[n] != st) break; {same} }}\n"
            "      int c = r->count; r->start[c] = (unsigned char)j; r->len[c] = (unsigned char)len;"
            " r->step[c] = (unsigned char)st;\n"
            "      for (int q = 0; q < 4; ++q) r->slope[c][q] = (unsigned char)sl[q];\n"
            "      r->count++; j += len; } }"
        )

    # ---- packing -------------------------------------------------------------------------
    def pack_b_call(self, n0: str, nc: str, dst: str) -> str:
        if self.b_rows:
            return f"tk_pack_b_rows(Bbt, b_k + pc, {n0}, {nc}, kc, {dst});"
        return f"tk_pack_b_table(Bbt, b_k + pc, b_n, pstep, pruns, {n0}, {nc}, kc, &gd, {dst});"

    def pack_a_call(self, m0: str, mc: str, dst: str) -> str:
        return f"tk_pack_a(Abt, a_m + {m0}, a_k + pc, {mc}, kc, {dst});"

    def pack_block(self, which: str, shared: bool) -> str:
        if which == self.prepacked:  # the whole operand is packed already: find the block in it
            if which == "A":
                return f"Ap = AP + pc * {self.mp} + ic * kc;"
            return f"Bp = BP + pc * {self.np} + jc * kc;"
        if which == "A":
            if not self.pack_a:
                return ""
            if not shared:
                return self.pack_a_call("ic", "mc", "Ap")
            return (
                "#pragma omp for schedule(static)\n"
                "for (long p = 0; p < mc; p += TK_MR) "
                + self.pack_a_call("ic + p", "tk_min(TK_MR, mc - p)", "Ap + p * kc")
            )
        if not self.pack_b or self.fuse_b:  # (fuse_b: each panel is packed by its first tile)
            return ""
        if not shared:
            return self.pack_b_call("jc", "nc", "Bp")
        return (
            "#pragma omp for schedule(static)\n"
            "for (long p = 0; p < nc; p += TK_NR) " + self.pack_b_call("jc + p", "tk_min(TK_NR, nc - p)", "Bp + p * kc")
        )

    # ---- the micro-kernel call -----------------------------------------------------------
    def ukernel_call(self) -> str:
        if self.c_cols:
            lines = ["float *c_ = Cbt + (jc + jr); const long *ncol = 0;"]
        else:  # a panel whose columns are contiguous is stored with vectors all the same
            lines = ["long cp = cpanel[(jc + jr) / TK_NR]; float *c_ = Cbt + (cp ? c_n[jc + jr] : 0);",
                     "const long *ncol = cp ? 0 : c_n + jc + jr;"]
        tail = "c_, c_m + ic + ir, ncol, pc == 0, mr, nr"
        if self.pack_a:
            a = "Ap + ir * kc, 1, TK_MR"
        else:
            rs, cs = self.a_scale
            lines.append(f"const float *a_ = Abt + (ic + ir) * {rs}L + pc * {cs}L; long a_rs = {rs}, a_cs = {cs};")
            lines.append("if (mr < TK_MR) { tk_pack_a(Abt, a_m + ic + ir, a_k + pc, mr, kc, At); a_ = At; a_rs = 1; a_cs = TK_MR; }")
            a = "a_, a_rs, a_cs"
        if self.pack_b:
            b = "Bp + jr * kc, TK_NR"
            if self.fuse_b:
                first = "ir == 0" if self.s.order == "ic,pc,jc" else "ic == 0 && ir == 0"
                nxt = self.next_b_rows(fused=True)
                rest = (f"{{ {nxt[0]} tk_ukernel_pfrows(kc, {a}, {b}, {tail}, {nxt[1]}); }}" if nxt
                        else f"tk_ukernel(kc, {a}, {b}, {tail}, 0, 0);")
                return "{ " + " ".join(lines) + (
                    f" if ({first} && nr == TK_NR) tk_ukernel_packing_b(kc, {a}, Bbt + pc * {self.b_rs}L + jc + jr,"
                    f" {self.b_rs}, Bp + jr * kc, {tail});"
                    f" else {{ if ({first}) tk_pack_b_rows(Bbt, b_k + pc, jc + jr, nr, kc, Bp + jr * kc);"
                    f" {rest} }} }}")
        else:
            lines.append(f"const float *b_ = Bbt + pc * {self.b_rs}L + jc + jr; long b_rs = {self.b_rs};")
            lines.append(
                "if (nr < TK_NR) { tk_pack_b_rows(Bbt, b_k + pc, jc + jr, nr, kc, Bt); b_ = Bt; b_rs = TK_NR; }"
            )
            b = "b_, b_rs"
        nxt = None if self.pack_b else self.next_b_rows(fused=False)
        if nxt:
            lines.append(f"{nxt[0]} tk_ukernel_pfrows(kc, {a}, {b}, {tail}, {nxt[1]});")
            return "{ " + " ".join(lines) + " }"
        pf = self.prefetch_next_panel()
        lines.append(pf)
        lines.append(f"tk_ukernel(kc, {a}, {b}, {tail}, {'pf_, npf_' if pf else '0, 0'});")
        return "{ " + " ".join(lines) + " }"

    def next_b_rows(self, fused: bool) -> tuple[str, str] | None:
        """The arguments that have this row tile fetch its share of the next B panel's rows from
        B's matrix (``prefetch_next_b``), or None when the schedule does not ask. The share: the
        panel's kc rows over its row tiles (over all but the first when the first packs the panel,
        and only in the pass that packs it). Returns (declarations, arguments).
        A prefetch past B's end (the last panel's next) is dropped, never a fault."""
        if not self.s.prefetch_next_b or self.prepacked == "B" or not (fused or not self.pack_b):
            return None
        tiles, tile = ("(mc + TK_MR - 1) / TK_MR - 1", "ir / TK_MR - 1") if fused else ("(mc + TK_MR - 1) / TK_MR", "ir / TK_MR")
        # under jc,pc,ic a fused panel is packed in the first ic block; the later ones read it packed
        live = " && ic == 0" if fused and self.s.order == "jc,pc,ic" else ""
        return (f"long nt_ = {tiles}, sh_ = nt_ > 0 ? (kc + nt_ - 1) / nt_ : 0, r0_ = ({tile}) * sh_;"
                f" long r1_ = nt_ > 0 && r0_ >= 0{live} ? tk_min(kc, r0_ + sh_) : r0_;",
                f"Bbt + pc * {self.b_rs}L + jc + jr + TK_NR, {self.b_rs}L, r0_, r1_")

    def prefetch_next_panel(self) -> str:
        """A prepacked operand's micro-panel held across the inner loop is read from memory the
        first time, not from a copy just made: the next one is fetched into L2 a slice per call
        of the inner loop (``pf_``, ``npf_``: lines the micro-kernel prefetches spread over its k
        loop, as the serving dense kernel does with its packed weight; a prefetch past the end is
        dropped, never a fault)."""
        held = "B" if self.s.inner == "jr,ir" else "A"
        if self.prepacked != held:
            return ""
        outer, inner, extent, unit = ("jr", "ir", "mc", "TK_MR") if held == "B" else ("ir", "jr", "nc", "TK_NR")
        width = "TK_NR" if held == "B" else "TK_MR"
        return (
            f"long npf_; const char *pf_ = tk_pf_share((const char *)({held}p + ({outer} + {width}) * kc),"
            f" {width} * kc / 16, ({extent} + {unit} - 1) / {unit}, {inner} / {unit}, &npf_);"
        )

    # ---- the loop nest -------------------------------------------------------------------
    def nest(self) -> tuple[tuple[str, ...], str | None, int, dict[str, int], dict[str, bool]]:
        """The loop nest's shape: the loops in order, the parallel one (None: none), its depth,
        the loop each operand's block is packed in, and whether that block is shared by the
        threads. Also sets ``fuse_b``."""
        s = self.s
        outer = LEVELS[s.order]
        inner = ("jr", "ir") if s.inner == "jr,ir" else ("ir", "jr")
        order = ("bt", *outer, *inner)
        par = {"none": None, "batch": "bt"}.get(s.parallel, s.parallel)
        depth = order.index(par) if par else len(order)
        pack_at = {"A": order.index("pc") if outer[0] == "ic" else order.index("ic"),
                   "B": order.index("pc") if outer[0] == "jc" else order.index("jc")}
        # a block packed outside the parallel loop is shared (each thread packs a share of its
        # panels), except B's under a parallel ir loop: every thread reads all of that block, and
        # the half another core packed comes from L3 (memory speed on the Intel VM), so each
        # thread packs its own copy (512x3072x768 on 2 threads 368 -> 384 GFLOP/s; 2048^3 +1%)
        shared = {w: pack_at[w] < depth and not (w == "B" and par == "ir") for w in ("A", "B")}
        # B packed panel by panel by each panel's first tile (tk_ukernel_packing_b) when the
        # schedule asks, where the thread that packs a panel is the only one that reads it: a
        # block of its own (not under a parallel ir loop, whose threads start at other rows), or
        # a shared one split by panels
        self.fuse_b = (s.pack_b_first_tile and self.pack_b and self.prepacked != "B" and self.b_rows
                       and self.b_rs is not None and (par == "jr" if shared["B"] else par != "ir"))
        return order, par, depth, pack_at, shared

    def loops(self) -> str:
        s = self.s
        order, par, depth, pack_at, shared = self.nest()
        heads = {
            "bt": f"for (long bt = 0; bt < {self.BT}; ++bt) {{ const float *Abt = A + a_bt[bt], *Bbt = B + b_bt[bt]; float *Cbt = C + c_bt[bt];",
            "jc": f"for (long jc = 0; jc < {self.N}; jc += {s.nc}) {{ long nc = tk_min({s.nc}, {self.N} - jc);",
            "pc": f"for (long pc = 0; pc < {self.K}; pc += {s.kc}) {{ long kc = tk_min({s.kc}, {self.K} - pc);"
            + self.guard_struct(),
            "ic": f"for (long ic = 0; ic < {self.M}; ic += {s.mc}) {{ long mc = tk_min({s.mc}, {self.M} - ic);",
            "jr": "for (long jr = 0; jr < nc; jr += TK_NR) { long nr = tk_min(TK_NR, nc - jr);",
            "ir": "for (long ir = 0; ir < mc; ir += TK_MR) { long mr = tk_min(TK_MR, mc - ir);",
        }
        code = []
        for i, level in enumerate(order):
            if i == depth:
                # no barrier after the parallel loop: each thread owns the same C tiles in every
                # pass of the loops around it (static schedule, the same trip count for the same
                # block), so the next pass may start while the other thread finishes this one;
                # only a shared block's repacking waits for all (the barrier before it, below).
                # With the parallel loop inside ir (or jr), that was a barrier per 8 rows of C
                # (per micro-panel of B).
                code.append("#pragma omp for schedule(static) nowait")
            code.append(heads[level])
            for which in ("A", "B"):
                if pack_at[which] == i:
                    block = self.pack_block(which, shared=shared[which])
                    if block.startswith("#pragma omp for"):  # a shared block, packed by all: from
                        # the second on, nobody may still read the last one (every loop starts at
                        # 0 and all threads run the loops around it alike: all or none meet it)
                        later = " || ".join(order[:i + 1])
                        block = f"if ({later}) {{\n#pragma omp barrier\n}}\n" + block
                    code.append(block)
        code.append(self.ukernel_call())
        code.append("}" * len(order))
        self.shared = shared
        return "\n".join(code)

    def guard_struct(self) -> str:
        if not self.guards:
            return " tk_guards gd = {{0}, {0}, {0}, {0}}; (void)gd;"
        parts = [f"gd.gn[{g}] = g{g}_n; gd.gk[{g}] = g{g}_k + pc; gd.gb[{g}] = g{g}_bt[bt]; gd.lim[{g}] = {lim};"
                 for g, lim in enumerate(self.c.b.tensor.shape[d] for d in self.guards)]
        return " tk_guards gd; " + " ".join(parts)

    @property
    def mp(self) -> int:
        return -(-self.M // self.s.mr) * self.s.mr

    @property
    def np(self) -> int:
        return -(-self.N // self.s.nr) * self.s.nr

    def run_function(self, prepacked: str | None, name: str = "tk_run") -> list[str]:
        s = self.s
        self.prepacked = prepacked
        body = self.loops()
        alloc = {"A": f"tk_alloc({s.mc} * {s.kc})", "B": f"tk_alloc({s.nc} * {s.kc})"}
        mine = [w for w in "AB" if w != prepacked]
        shared = "".join(f"float *{w}s = {alloc[w]};" for w in mine if self.shared[w])
        private = "".join(f"float *{w}p = {w}s;" if self.shared[w] else f"float *{w}p = {alloc[w]};" for w in mine)
        if prepacked:
            private += f"const float *{prepacked}p = 0;"
        frees = "".join(f"free({w}p);" for w in mine if not self.shared[w])
        free_shared = "".join(f"free({w}s);" for w in mine if self.shared[w])
        a_arg, b_arg = self.arg(self.c.a.tensor), self.arg(self.c.b.tensor)
        name, extra = ("tk_run_prepacked", f" const float *restrict {prepacked}P,") if prepacked else (name, "")
        self.prepacked = None
        return [
            f"void {name}(float *restrict out, const float *restrict in0, const float *restrict in1,{extra} int nthreads) {{",
            f"  const float *A = {a_arg}, *B = {b_arg}; float *C = out; (void)A; (void)B;",
            "  nthreads = 1;" if s.parallel == "none" else "",
            f"  {shared}",
            "#pragma omp parallel num_threads(nthreads)",
            "  {",
            f"  {private} float *At = tk_alloc(TK_MR * {s.kc}), *Bt = tk_alloc(TK_NR * {s.kc}); (void)At; (void)Bt;",
            body,
            # every thread done before any frees, as when the parallel loop ended in a barrier
            # (a free may unmap pages, which interrupts the other core)
            "#pragma omp barrier",
            f"  {frees} free(At); free(Bt);",
            "  }",
            f"  {free_shared}",
            "}",
        ]

    def b_in_place_when_lined(self) -> list[str]:
        """A schedule that reads B in place does so when B's rows start on cache lines (its
        start, each batch's and the row stride on 64 bytes), and packs B otherwise: a vector
        load of a row 16 bytes off a line (numpy's large arrays lie so) touches two lines, and
        128x768x3072 with B in place ran at 106 to 154 GFLOP/s by where B lay. So a B off its
        lines costs what packing costs, never the split loads."""
        in_place = self.run_function(None, name="tk_run_b_in_place")
        self.pack_b = True
        packing = self.run_function(None, name="tk_run_b_packed")
        self.pack_b = False
        b_arg = self.arg(self.c.b.tensor)
        lined = "1" if (4 * self.b_rs) % 64 == 0 else "0"
        return [
            *in_place, *packing,
            "void tk_run(float *restrict out, const float *restrict in0, const float *restrict in1, int nthreads) {",
            f"  int lined = {lined};",
            f"  for (long bt = 0; bt < {self.BT} && lined; ++bt) lined = (((size_t)({b_arg} + b_bt[bt])) & 63) == 0;",
            "  if (lined) tk_run_b_in_place(out, in0, in1, nthreads); else tk_run_b_packed(out, in0, in1, nthreads);",
            "}",
        ]

    def prepack_functions(self, which: str) -> list[str]:
        """``tk_prepack`` (the whole operand, k block by k block) and its size."""
        s = self.s
        ins = [t.name for t in self.c.op.inputs]
        acc = self.c.a if which == "A" else self.c.b
        arg = f"in{ins.index(acc.tensor.name)}"
        rows = self.mp if which == "A" else self.np
        pack = (self.pack_a_call("0", str(self.M), "dst + pc * " + str(rows)) if which == "A"
                else self.pack_b_call("0", str(self.N), "dst + pc * " + str(rows)))
        return [
            f"const long tk_prepacked_floats = {rows}L * {self.K};",
            f"const int tk_prepacked_input = {ins.index(acc.tensor.name)};",
            f"void tk_prepack(const float *restrict {arg}, float *restrict dst) {{",
            f"  const float *{'Abt' if which == 'A' else 'Bbt'} = {arg} + {'a' if which == 'A' else 'b'}_bt[0];",
            "  tk_guards gd = {{0}, {0}, {0}, {0}}; (void)gd;",
            f"  for (long pc = 0; pc < {self.K}; pc += {s.kc}) {{ long kc = tk_min({s.kc}, {self.K} - pc); {pack} }}",
            "}",
        ]

    def source(self, header: str, prepacked: str | None = None) -> str:
        s = self.s
        self.tables()
        if prepacked is not None and not self.prepackable(prepacked):
            raise ValueError(f"{self.c.op.name}: operand {prepacked} cannot be prepacked under {s.short()} "
                             "(it must be packed by the schedule, with no batch loop and, for B, no zero padding)")
        if prepacked:
            run = [*self.prepack_functions(prepacked), *self.run_function(prepacked)]
        elif not self.pack_b:
            run = self.b_in_place_when_lined()
        else:
            run = self.run_function(None)
        return "\n".join([
            f"/* {self.c.op.signature()}\n * schedule: {s.short()}" + (f", {prepacked} prepacked" if prepacked else "") + " */",
            f"#define TK_VEC {256 if s.isa == 'avx2' else 512}",
            f"#define TK_MR {s.mr}", f"#define TK_NR {s.nr}", f"#define TK_UNROLL {s.unroll}",
            f"#define TK_NG {len(self.guards)}", f"#define TK_PFB {s.prefetch_b}",
            f'#include "{header}"',
            *self.decls,
            "void tk_init(void) {", *self.fills, "}",
            *run,
        ]) + "\n"


def generate_gemm(op, schedule: GemmSchedule, header: str = "tessera_primitives.h", prepacked: str | None = None) -> str:
    """C source of ``op`` (a contraction) under ``schedule``; with ``prepacked`` ("A" or "B"),
    the source of the run that reads that operand packed whole by ``tk_prepack``."""
    return _Gen(analyse(op, fuse_n=schedule.fuse_n), schedule).source(header, prepacked)


def prepackable(op, schedule: GemmSchedule, which: str) -> bool:
    return _Gen(analyse(op, fuse_n=schedule.fuse_n), schedule).prepackable(which)


def packs_b_by_first_tile(op, schedule: GemmSchedule) -> bool:
    """Whether ``schedule``'s plain run packs B panel by panel in each panel's first tile (it
    asks for it, B is a strided matrix it packs, and no other thread reads a panel first)."""
    g = _Gen(analyse(op, fuse_n=schedule.fuse_n), schedule)
    g.nest()
    return g.fuse_b


def b_bytes(op) -> int:
    """Bytes of the contraction's B operand (its whole tensor: every image of a convolution)."""
    return 4 * analyse(op).b.tensor.numel


def effective_packing(op, schedule: GemmSchedule) -> tuple[bool, bool]:
    """(pack A, pack B) as compiled: an operand that is not a plain strided matrix is always packed."""
    g = _Gen(analyse(op, fuse_n=schedule.fuse_n), schedule)
    return g.pack_a, g.pack_b

