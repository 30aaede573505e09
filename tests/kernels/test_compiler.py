"""The precompiled prelude (tessera.kernels.compiler) is only a faster way to read the system
headers: a kernel built with it is byte for byte the library built without it, for each kind
of generated source (a GEMM, a depthwise convolution, a factored stencil built both with and
without FMA contraction), and a prelude gcc cannot use leaves the compile to the headers' text."""

import os
import subprocess

import pytest

from tessera.kernels import compiler, ops
from tessera.kernels.direct import direct_space, generate_direct
from tessera.kernels.kernel import generate
from tessera.kernels.schedule import GemmSchedule
from tessera.stencil import StencilSchedule, make_stencil
from tessera.stencil.codegen import generate_apply
from tessera.stencil.kernel import NO_CONTRACTION


def _sources():
    yield "gemm", generate(ops.gemm(7, 9, 5), GemmSchedule(mc=6, nc=16, kc=4)), "avx2", ()
    shape = ops.Conv2dShape(batch=1, in_channels=6, out_channels=6, height=9, width=11, kernel=(3, 3),
                            padding=(1, 1), groups=6)  # fmt: skip
    depthwise = ops.conv2d(shape)
    schedule = direct_space(depthwise, isas=("avx2",))[0]
    yield "depthwise", generate_direct(depthwise, schedule), "avx2", ()
    stencil = generate_apply(make_stencil("ete37", "class"), (5, 7, 19), StencilSchedule(rz=2, tz=3, ty=5, factor=True, isa="avx2"))
    yield "stencil", stencil, "avx2", ()
    yield "stencil", stencil, "avx2", NO_CONTRACTION


def _build(monkeypatch, folder, source, isa, flags, pch: bool):
    monkeypatch.setenv("TESSERA_KERNEL_CACHE", str(folder))
    if pch:
        monkeypatch.delenv("TESSERA_NO_PCH", raising=False)
    else:
        monkeypatch.setenv("TESSERA_NO_PCH", "1")
    return compiler.compile_source(source, isa=isa, name="k", extra_flags=flags)


def test_the_prelude_changes_no_byte_of_a_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_KERNEL_CACHE", str(tmp_path / "pch"))
    monkeypatch.delenv("TESSERA_NO_PCH", raising=False)
    cc = compiler.find_compiler()
    if not compiler.prelude_include(cc, cc.flags("avx2")):
        pytest.skip("this compiler precompiles no prelude (clang compiles from the headers' text)")
    for i, (what, source, isa, flags) in enumerate(_sources()):
        fast = _build(monkeypatch, tmp_path / "pch", source, isa, flags, pch=True)
        plain = _build(monkeypatch, tmp_path / f"plain{i}", source, isa, flags, pch=False)
        assert not fast.cached and not plain.cached and fast.key == plain.key
        assert fast.path.read_bytes() == plain.path.read_bytes(), (what, flags)
    # one precompiled prelude a flag set: with and without contraction
    assert len(list((tmp_path / "pch" / "pch").glob("*/tessera_prelude.h.gch"))) == 2
    assert not list((tmp_path / "plain0").glob("pch"))
    # and gcc reads it: -H marks a precompiled header it used with "!"
    monkeypatch.setenv("TESSERA_KERNEL_CACHE", str(tmp_path / "pch"))
    monkeypatch.delenv("TESSERA_NO_PCH")
    flags = cc.flags("avx2")
    (tmp_path / "t.c").write_text("int f(void) { return 0; }\n")
    cmd = [cc.path, *flags, *compiler.prelude_include(cc, flags), "-H", str(tmp_path / "t.c"), "-o", str(tmp_path / "t.so")]
    shown = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    assert any(line.startswith("!") and line.endswith("tessera_prelude.h.gch") for line in shown.splitlines()), shown[:300]


def test_an_unusable_prelude_falls_back_to_the_headers(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("TESSERA_NO_PCH", raising=False)
    cc = compiler.find_compiler()
    flags = cc.flags("avx2")
    args = compiler.prelude_include(cc, flags)
    if not args:
        pytest.skip("this compiler precompiles no prelude")
    (gch,) = tmp_path.glob("pch/*/tessera_prelude.h.gch")
    gch.write_bytes(b"not a precompiled header")  # e.g. a cache copied from another gcc
    _, source, isa, extra = next(_sources())
    built = compiler.compile_source(source, isa=isa, name="k")
    assert built.path.exists() and not built.cached
    assert os.path.getsize(built.path) > 0
