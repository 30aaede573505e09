"""Bad input is a one-line error that names it: shapes that do not match the operator, an
unsupported dtype, a missing or failing C compiler (which says how to install one), a
schedule the generator cannot honour. The cache is keyed so that a changed schedule or
compiler never reuses another's binary."""

import os
import stat

import numpy as np
import pytest
from kernel_checks import random_inputs, run

from tessera.kernels import CompilerError, compile_kernel, ops
from tessera.kernels.codegen_loops import generate_loops
from tessera.kernels.compiler import cache_dir, compile_source, find_compiler
from tessera.kernels.kernel import generate
from tessera.kernels.schedule import GemmSchedule, LoopSchedule

OP = ops.gemm(5, 6, 7)


def test_kernel_checks_its_inputs():
    kernel = compile_kernel(OP, GemmSchedule())
    a, b = (np.ones(t.shape, np.float32) for t in OP.inputs)
    with pytest.raises(ValueError, match=r"input B has shape \(6, 7\); the operator expects \(7, 6\)"):
        kernel(a, np.ones((6, 7), np.float32))
    with pytest.raises(ValueError, match="dtype float64; the kernel takes float32"):
        kernel(a.astype(np.float64), b)
    with pytest.raises(ValueError, match="not contiguous"):
        kernel(np.ones((7, 5), np.float32).T, b)
    with pytest.raises(ValueError, match="takes 2 inputs"):
        kernel(a)
    with pytest.raises(ValueError, match="threads must be"):
        kernel(a, b, threads=0)


def test_a_bound_call_checks_once_and_writes_its_output():
    kernel = compile_kernel(OP, GemmSchedule())
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(t.shape, dtype=np.float32) for t in OP.inputs)
    call, out = kernel.bind(a, b, threads=2)
    out[:] = np.nan
    call()
    np.testing.assert_array_equal(out, kernel(a, b, threads=2))  # one binary, one order of sums
    b[:] = 0  # the call reads the arrays it was bound to, as they are when it runs
    call()
    assert not out.any()
    with pytest.raises(ValueError, match="not contiguous"):
        kernel.bind(np.ones((7, 5), np.float32).T, b)
    with pytest.raises(ValueError, match="threads must be"):
        kernel.bind(a, b, threads=0)


def _fake_compiler(tmp_path, script: str):
    path = tmp_path / "fakecc"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_missing_compiler_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(CompilerError, match="not found; install one, e.g. `apt-get install gcc`"):
        compile_kernel(ops.gemm(3, 3, 3), GemmSchedule(mc=6, nc=16, kc=2))
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, cc or clang anywhere
    with pytest.raises(CompilerError, match=r"no C compiler found .*apt-get install gcc"):
        find_compiler()


def test_failing_compiler_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    cc = _fake_compiler(tmp_path, 'if [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\necho "error: broken" >&2; exit 1\n')
    monkeypatch.setenv("CC", cc)
    with pytest.raises(CompilerError, match="failed on generated kernel gemm_nn: error: broken"):
        compile_kernel(ops.gemm(3, 3, 4), GemmSchedule())
    assert not list(cache_dir().glob("*/*.partial"))


def test_cache_hits_and_keys(monkeypatch):
    op, s = ops.gemm(3, 5, 2), GemmSchedule(mc=6, nc=16, kc=2)
    first = compile_source(generate(op, s), isa="avx2")
    again = compile_source(generate(op, s), isa="avx2")
    assert again.cached and again.path == first.path and again.compile_seconds == 0.0
    assert str(first.path).startswith(str(cache_dir())) and first.path.with_suffix(".c").exists()
    other = compile_source(generate(op, GemmSchedule(mc=6, nc=16, kc=1)), isa="avx2")
    assert other.key != first.key
    inputs = random_inputs(op)
    assert np.array_equal(run(compile_kernel(op, s), op, inputs), run(compile_kernel(op, s), op, inputs))


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_KERNEL_CACHE", str(tmp_path / "elsewhere"))
    done = compile_source(generate(OP, GemmSchedule(kc=3)), isa="avx2")
    assert done.path.parent.parent == tmp_path / "elsewhere" and not done.cached
    monkeypatch.delenv("TESSERA_KERNEL_CACHE")
    assert cache_dir() == __import__("pathlib").Path(os.path.expanduser("~/.cache/tessera/kernels"))


def test_schedules_the_generator_cannot_honour():
    with pytest.raises(ValueError, match="multiple of the avx2 vector length 8"):
        GemmSchedule(nr=12)
    with pytest.raises(ValueError, match="needs 19 vector registers; avx2 has 16"):
        GemmSchedule(mr=8, nr=16)
    with pytest.raises(ValueError, match="mc=10 must be a positive multiple of 6"):
        GemmSchedule(mc=10)
    with pytest.raises(ValueError, match="prefetch_b=8 applies to B read in place; use pack_b=False"):
        GemmSchedule(prefetch_b=8)
    with pytest.raises(ValueError, match="prefetch_b=-1 must be an int >= 0"):
        GemmSchedule(pack_b=False, prefetch_b=-1)
    with pytest.raises(ValueError, match="pack_b_first_tile=True packs B panel by panel; it needs pack_b=True"):
        GemmSchedule(pack_b=False, pack_b_first_tile=True)
    with pytest.raises(ValueError, match="prefetch_next_b=True fetches B's next panel from its matrix; it needs B read"):
        GemmSchedule(prefetch_next_b=True)
    with pytest.raises(ValueError, match="prefetch_next_b=True needs inner='jr,ir'"):
        GemmSchedule(pack_b=False, inner="ir,jr", prefetch_next_b=True)
    s = ops.Conv2dShape(batch=1, in_channels=2, out_channels=2, height=5, width=5, kernel=(3, 3), padding=(1, 1))
    col2im = ops.col2im(s)
    with pytest.raises(ValueError, match="axis 'oh' does not own its output elements"):
        generate_loops(col2im, LoopSchedule(order=("oh", "ci", "r", "s", "ow"), parallel=1))
    with pytest.raises(ValueError, match="vectorised reduction loop cannot also be unrolled"):
        generate_loops(OP, LoopSchedule(order=("m", "n", "k"), unroll=4))
    with pytest.raises(ValueError, match="misses axes"):
        generate_loops(OP, LoopSchedule(order=("m", "n")))


def test_sizes_dtypes_and_devices_are_named_in_one_line():
    """A zero or negative size, a tensor on another device, mixed dtypes through the torch
    ops: each a ValueError of one line naming the value."""
    import torch

    from tessera.kernels import torch_ops

    cases = [
        (lambda: ops.gemm(0, 4, 4), "m must be an int >= 1, got 0"),
        (lambda: ops.Conv2dShape(batch=-1, in_channels=3, out_channels=4, height=8, width=8, kernel=(3, 3)),
         "batch must be an int >= 1, got -1"),
        (lambda: ops.Conv2dShape(batch=1, in_channels=3, out_channels=4, height=8, width=8, kernel=(3, 0)),
         "kernel must be an int >= 1, got 0"),
        (lambda: compile_kernel(OP, GemmSchedule())(torch.ones(5, 7, device="meta"), torch.ones(7, 6)),
         "input A is on meta; Tessera's kernels run on the CPU"),
        (lambda: torch_ops.matmul(torch.ones(5, 7), torch.ones(7, 6, dtype=torch.float64)),
         "tessera::matmul: b has dtype torch.float64; Tessera's kernels take float32"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as exc:
            call()
        assert message in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
