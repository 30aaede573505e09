"""The serving kernels against plain float64 references of their own semantics: the dense
layer (``Y = X W^T + b (+ R)``, any row count, tails of every tile) and the packed
variable-length attention (softmax(scale Q K^T) V within each input and head)."""

import math
import statistics

import pytest
import torch

from tessera.kernels import attention as attn
from tessera.kernels import dense as dense_module
from tessera.kernels.dense import AmxSchedule, amx_ready, amx_schedules, dense_kernel, reference
from tessera.kernels.machine import load_machine


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# "off": the AVX kernels; "auto": the AMX kernel (bf16x6 tiles), where this CPU has AMX-BF16
ENGINES = ["off", "auto"]


def _kernel(n, k, amx):
    """The AVX kernel as tuned, or the AMX kernel at its default blocks (built directly: a
    measured choice on record for this shape may be an AVX kernel)."""
    if amx == "off":
        return dense_kernel(n, k, amx="off")
    if amx_ready() is not None:
        pytest.skip(f"no AMX kernel here: {amx_ready()}")
    kernel = dense_module._build(n, k, amx_schedules(k)[0])
    assert isinstance(kernel.schedule, AmxSchedule)
    return kernel


# N and K that are not multiples of the register tile (NR 32-48; AMX: 32 columns), of KC
# (128-256) or of AMX's k tile (32); K = 1600: three of the AMX kernel's k blocks (768, 768, 64)
@pytest.mark.parametrize("amx", ENGINES)
@pytest.mark.parametrize("n,k", [(384, 384), (37, 300), (3, 64), (1000, 129), (40, 1600)])
def test_dense_equals_the_float64_reference_at_any_row_count(n, k, amx):
    kernel = _kernel(n, k, amx)
    g = _gen(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(w)
    for m in (0, 1, 5, 97, 300):
        x, r = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
        for residual in (None, r):
            got = kernel(x, packed, b, residual)
            want = reference(x, w, b, residual)
            # fp32 sums of k products of N(0,1) values: rounding ~ sqrt(k) * 2^-24 * |terms|;
            # 1e-4 absolute on outputs of size ~sqrt(k) (10-40) is ~1e-5 relative, 10x above
            # what the kernel shows (3e-5 at k=384), far below any indexing error (~1); the
            # AMX kernel's left-out products add < 2^-23 of each product, below that rounding
            torch.testing.assert_close(got.double(), want, atol=1e-4 * max(1.0, k / 1000), rtol=1e-5)
    # the LayerNorm of BERT's output blocks, in the kernel: float64 reference of dense + residual
    # then LayerNorm; outputs are O(1) after normalising, so 2e-5 absolute is ~10x the fp32
    # rounding of a K-term sum divided by a row's standard deviation (~sqrt(k))
    ln = (torch.randn(n, generator=g), torch.randn(n, generator=g), 1e-12)
    if n > 1:  # a LayerNorm over one value is constant
        x, r = torch.randn(50, k, generator=g), torch.randn(50, n, generator=g)
        got = kernel(x, packed, b, r, layer_norm=ln)
        torch.testing.assert_close(got.double(), reference(x, w, b, r, ln), atol=2e-5, rtol=1e-5)
    # BERT's intermediate layer: GELU (erf) in the epilogue; its own error (<= 0.75e-7 |y|) is far
    # below the sum's rounding, so the dense tolerance above holds
    x = torch.randn(97, k, generator=g)
    torch.testing.assert_close(kernel(x, packed, b, gelu=True).double(), reference(x, w, b, gelu=True),
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    # threads split W's panels, never K: the same bits at 1 and 2 threads
    x = torch.randn(77, k, generator=g)
    for gelu in (False, True):
        assert torch.equal(kernel(x, packed, b, gelu=gelu, threads=1), kernel(x, packed, b, gelu=gelu, threads=2))
        # a row's result does not depend on the rows batched with it (a full tile or a tail)
        assert torch.equal(kernel(x, packed, b, gelu=gelu)[5:6], kernel(x[5:6].clone(), packed, b, gelu=gelu))


@pytest.mark.parametrize("mr,nr", [(8, 32), (6, 32)])
def test_dense_packs_rows_of_every_tile_height(mr, nr):
    """Full row tiles are read in place, a tail of fewer rows packed into a zero-padded panel,
    at two tile heights. K = 300 (two KC blocks of 256 + 44) and row counts around the tile and
    over several blocks of rows."""
    import dataclasses

    n, k = 70, 300
    base = dense_kernel(n, k, amx="off").schedule
    nr = nr if base.isa == "avx512" else 8  # AVX2's 16 registers: an 8 x 8 tile
    schedule = dataclasses.replace(base, mr=mr, nr=nr, kc=256, mc=4 * mr, nc=nr * 3)
    kernel = dense_module._build(n, k, schedule)
    g = _gen(mr)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(w)
    # 4 MR + 3 rows fit one block (blocks hold up to MC x 5/4 rows); 12 MR + 5 make three of
    # near-equal rows (MR multiples), the last with a tail tile
    for m in (1, 7, 8, 9, 4 * mr + 3, 12 * mr + 5):
        x = torch.randn(m, k, generator=g)
        # the tolerance of the dense test above (sums of 300 products of N(0, 1) values)
        torch.testing.assert_close(kernel(x, packed, b).double(), reference(x, w, b), atol=1e-4, rtol=1e-5)
        # and a row's bits do not depend on the block it falls in
        assert torch.equal(kernel(x, packed, b)[-1:], kernel(x[-1:].clone(), packed, b))


@pytest.mark.parametrize("amx", ENGINES)
def test_dense_gelu_equals_the_float64_gelu(amx):
    """Through an identity weight each output is one input value exactly (every other product
    is a zero; AMX's three bfloat16 parts of a value sum back to it exactly), so what is left is
    the epilogue's GELU alone, against float64 over [-12, 12], the tails and zero included."""
    n = 64
    kernel = _kernel(n, n, amx)
    packed = kernel.pack(torch.eye(n))
    x = torch.cat([torch.linspace(-12, 12, 64 * 63), torch.tensor([0.0, -0.0, 1e-30, -1e-30] + [-40.0, 40.0] * 30)])
    x = x.reshape(-1, n)
    got = kernel(x, packed, torch.zeros(n), gelu=True)
    want = torch.nn.functional.gelu(x.double())
    # Abramowitz-Stegun 7.1.26 bounds erf's error by 1.5e-7, so GELU's by 0.75e-7 |x| (the
    # float32 rounding of x / sqrt 2 and of the products adds a few ulp): 1e-6 at |x| <= 12 is
    # ~10x that bound and far below a wrong formula (tanh-GELU differs by up to 5e-4)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    # far tails: GELU(40) is 40 exactly, GELU(-40) ~ -1e-348 (exp is held at e^-80 there)
    assert torch.equal(got[x == 40.0], x[x == 40.0]) and got[x == -40.0].abs().max() < 1e-30


@pytest.mark.parametrize("amx", ENGINES)
def test_dense_gelu_far_tail_is_never_subnormal(amx):
    """Where x <= -12.6 GELU is below 1e-35: the kernel's values there stay normal floats (a
    subnormal one costs a microcode assist per value: a layer with outputs near -20 ran its GELU
    2.8x slower), and keep GELU's sign and its vanishing size."""
    n = 64
    kernel = _kernel(n, n, amx)
    packed = kernel.pack(torch.eye(n))
    x = -torch.logspace(math.log10(12.0), 4, 64 * 32).reshape(-1, n)
    got = kernel(x, packed, torch.zeros(n), gelu=True)
    tiny = torch.finfo(torch.float32).tiny  # the smallest normal float32
    assert (got <= 0).all() and (got.abs() < 1e-30).all()
    assert ((got == 0) | (got.abs() >= tiny)).all(), got[(got != 0) & (got.abs() < tiny)]


def test_dense_refuses_bad_inputs_by_name():
    kernel = dense_kernel(8, 16)
    packed = kernel.pack(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"dense: x has shape \(4, 15\); expected \(4, 16\)"):
        kernel(torch.randn(4, 15), packed, torch.zeros(8))
    with pytest.raises(ValueError, match="dense: bias is torch.float64"):
        kernel(torch.randn(4, 16), packed, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="dense: packed weight has 3 torch.float32; pack"):
        kernel(torch.randn(4, 16), torch.zeros(3), torch.zeros(8))
    with pytest.raises(ValueError, match="dense_kernel: n must be a positive int, got 0"):
        dense_kernel(0, 16)
    with pytest.raises(ValueError, match="dense_kernel: amx='on'; choose one of auto, off"):
        dense_kernel(8, 16, amx="on")
    with pytest.raises(ValueError, match="dense: gelu=True and layer_norm together"):
        kernel(torch.randn(4, 16), packed, torch.zeros(8), gelu=True, layer_norm=(torch.ones(8), torch.zeros(8), 1e-5))


def test_dense_tuning_ranks_only_the_dense_loops(monkeypatch):
    """The dense kernel runs one loop structure (blocks of X's rows, k blocks, all of W's panels,
    each held across the rows; threads over W's panels) and takes only the tile, mc and kc
    from a schedule, so its model pick is one of that structure (the GEMM space also holds
    BLIS's other mapping, which it does not run)."""
    from tessera.kernels import dense

    monkeypatch.setattr(dense, "saved_choice", lambda *a: None)
    monkeypatch.setattr(dense, "save_choice", lambda *a: None)
    for threads in (1, 2):
        s = dense_kernel(768, 768, threads=threads, m_hint=2048, amx="off").schedule
        assert (s.order, s.inner, s.nc >= 768) == ("ic,pc,jc", "jr,ir", True)
        assert threads == 1 or s.parallel == "jr"


def test_dense_measured_tuning_times_distinct_kernels_then_finalist_rounds(monkeypatch):
    """mode="measure" compiles each distinct dense kernel of the shortlist once (schedules that
    differ only in what the dense loops ignore are one kernel), times them, then times the
    three fastest again in 3 interleaved rounds and keeps the best median of its rounds."""
    from tessera.kernels import dense, tuner

    saved, finalists = [], []
    monkeypatch.setattr(dense, "saved_choice", lambda *a: None)
    monkeypatch.setattr(dense, "save_choice", lambda op, threads, machine, s, mode: saved.append((s, mode)))

    def spy(picked, retime, **kw):
        keys = [(t.schedule.mr, t.schedule.nr, t.schedule.mc, t.schedule.kc) for t in picked]
        assert len(keys) == len(set(keys)) >= 2 and all(len(t.times) == 5 for t in picked)
        best = tuner.final_rounds(picked, retime, **kw)
        finalists.extend(t for t in picked if t.rounds)
        return best

    monkeypatch.setattr(dense, "final_rounds", spy)
    kernel = dense_kernel(40, 24, mode="measure", m_hint=16, amx="off")
    assert len(finalists) == min(tuner.FINALISTS, len(finalists)) >= 2
    assert all(len(t.rounds) == 3 for t in finalists)  # 3 rounds, one placement
    assert kernel.schedule == min(finalists, key=lambda t: statistics.median(t.rounds)).schedule
    assert saved == [(kernel.schedule, "measure")]


def test_amx_dense_is_as_accurate_as_a_float32_gemm():
    """The AMX kernel's six bfloat16 products a product (leaving out three below 2^-23 of it)
    and its two sums (the large products apart from the small ones) keep a float32 GEMM's
    error: against float64, within 1.5x of torch's float32 matmul on the same values, at K up to
    3072 (a BERT-base output layer). Three products (bf16x3) miss by 8-11x, one sum of all six
    by 2.3x at K = 3072 (each AMX product rounds its sum once a term)."""
    g = _gen(1)
    for k in (768, 3072):
        n, m = 64, 64
        kernel = _kernel(n, k, "auto")
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.zeros(n)
        want = reference(x, w, b)
        ours = (kernel(x, kernel.pack(w), b).double() - want).abs().max()
        fp32 = ((x @ w.T).double() - want).abs().max()
        assert ours <= 1.5 * fp32, (k, ours.item(), fp32.item())


def test_amx_measured_tuning_times_its_blocks_beside_the_avx_shortlist(monkeypatch):
    """mode="measure" on an AMX CPU times the AMX kernel's block choices beside the AVX
    shortlist, keeps the fastest finalist whichever kernel it is, and records it under a key of
    its own (the AVX-only key's record is not one of these measurements)."""
    from tessera.kernels import dense, tuner

    if amx_ready() is not None:
        pytest.skip(f"no AMX kernel here: {amx_ready()}")
    saved, picked_all, finalists = [], [], []
    monkeypatch.setattr(dense, "saved_choice", lambda *a: None)
    monkeypatch.setattr(dense, "save_choice", lambda op, threads, machine, s, mode: saved.append((op, s)))

    def spy(picked, retime, **kw):
        picked_all.extend(picked)
        best = tuner.final_rounds(picked, retime, **kw)
        finalists.extend(t for t in picked if t.rounds)
        return best

    monkeypatch.setattr(dense, "final_rounds", spy)
    kernel = dense_kernel(64, 800, mode="measure", m_hint=64)
    kinds = {type(t.schedule).__name__ for t in picked_all}
    assert kinds == {"GemmSchedule", "AmxSchedule"}
    assert {t.schedule for t in picked_all if isinstance(t.schedule, AmxSchedule)} == set(dense.amx_schedules(800))
    assert kernel.schedule == min(finalists, key=lambda t: statistics.median(t.rounds)).schedule
    (op, schedule), = saved
    assert schedule == kernel.schedule and op.signature().endswith("|amx")
    assert dense.DenseOp(64, 800, 64).signature() != op.signature()


def _segments(lengths):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


# isa None: the machine's widest (AVX-512 here); "avx2": the 8-wide build, whose transposes,
# tails and 2^n go through other code than the 16-wide one
@pytest.mark.parametrize("head_dim,isa", [(16, None), (32, None), (64, None), (32, "avx2"), (8, "avx2")])
def test_packed_attention_equals_the_float64_reference(head_dim, isa):
    if not attn.supports(head_dim) and isa is None:
        pytest.skip(f"no kernel for heads of {head_dim} on this ISA")
    if isa is not None and isa not in load_machine().peak_flops:
        pytest.skip(f"this CPU does not run {isa}")
    kernel = attn.attention_kernel(head_dim, isa)
    heads = 3
    for scale_up, lengths in ((1.0, [1, 2, 17, 33, 100]), (3.0, [64, 5, 250])):
        offsets = _segments(lengths)
        g = _gen(head_dim + len(lengths))
        # scale_up 3: scores of std ~9, softmax rows dominated by a few keys (the sharp case)
        q, k, v = (scale_up * torch.randn(offsets[-1], heads, head_dim, generator=g) for _ in range(3))
        got = kernel(q, k, v, torch.tensor(offsets), head_dim**-0.5)
        want = attn.reference(q, k, v, offsets, head_dim**-0.5)
        # fp32 scores and weights (the kernel's exp is within ~2e-7 relative): outputs of size
        # ~scale_up within 2e-5 absolute (measured at most 1.2e-5); a row attending across two
        # inputs, or a missed key, moves them by ~0.1-1
        torch.testing.assert_close(got.double(), want, atol=2e-5 * scale_up, rtol=1e-5)


def test_packed_attention_reads_column_slices_of_a_fused_projection():
    """Q, K and V as column slices of one (T, 3 H D) projection output (rows 3 H D apart) are
    read in place: the same bits as from contiguous copies, and the float64 reference."""
    d = 16 if attn.supports(16) else 8
    kernel = attn.attention_kernel(d)
    heads, offsets = 3, _segments([5, 40, 1, 17])
    t, width = offsets[-1], heads * d
    y = torch.randn(t, 3 * width, generator=_gen(5))
    q, k, v = (y[:, i * width : (i + 1) * width].view(t, heads, d) for i in range(3))
    assert not q.is_contiguous()
    got = kernel(q, k, v, torch.tensor(offsets), d**-0.5)
    assert torch.equal(
        got, kernel(q.contiguous(), k.contiguous(), v.contiguous(), torch.tensor(offsets), d**-0.5)
    )
    # the tolerance of the test above at scale 1
    torch.testing.assert_close(got.double(), attn.reference(q, k, v, offsets, d**-0.5), atol=2e-5, rtol=1e-5)


def test_packed_attention_refuses_bad_inputs_by_name():
    d = 16 if attn.supports(16) else 8
    kernel = attn.attention_kernel(d)
    q = torch.randn(10, 2, d)
    with pytest.raises(ValueError, match="attention: offsets must be int64 from 0 to 10"):
        kernel(q, q, q, torch.tensor([0, 9]), 0.25)
    with pytest.raises(ValueError, match=rf"attention: k is \(9, 2, {d}\)"):
        kernel(q, q[:9], q, torch.tensor([0, 10]), 0.25)
    with pytest.raises(ValueError, match="attention: no kernel for heads of 12 floats"):
        attn.attention_kernel(12)
