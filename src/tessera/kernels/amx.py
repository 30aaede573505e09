"""AMX-BF16 where the CPU has it: float32 products from bfloat16 tiles (``csrc/tessera_amx.h``:
each float split into three bfloat16 parts, six tile products a product, float32 accuracy).
The serving dense layer (``dense.py``) and the operator compiler's AMX GEMM (``direct.py``'s
``amx`` kernel, ``csrc/tessera_gemm_amx.h``) build on it; this module says whether it runs
here and what it is compiled with."""

from __future__ import annotations

from functools import cache

from tessera.kernels.compiler import CompilerError, compile_source, load
from tessera.kernels.machine import cpu_flags

AMX_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512bf16")
AMX_CPU_FLAGS = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f"}


def amx_source(n: int, k: int, kc: int, mb: int, extra: dict | None = None, header: str = "tessera_amx.h") -> str:
    """The defines of an AMX kernel for an ``N x K`` weight in blocks of ``mb`` rows by ``kc``
    of K (``extra``: more defines), then ``header``."""
    defines = {"TK_VEC": 512, "TK_N": n, "TK_K": k, "TK_KC": min(kc, k), "TK_MB": mb, **(extra or {})}
    return "".join(f"#define {name} {value}\n" for name, value in defines.items()) + f'#include "{header}"\n'


@cache
def amx_ready() -> str | None:
    """None where the AMX kernels build and Linux grants the tiles, else why not."""
    missing = AMX_CPU_FLAGS - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    try:
        lib = load(compile_source(amx_source(32, 32, 32, 32), isa="avx512", name="amx_probe", extra_flags=AMX_FLAGS))
    except (CompilerError, OSError) as exc:
        return f"the compiler did not build the AMX kernel ({str(exc).splitlines()[0]})"
    if not lib.tk_amx_ready():
        return "Linux did not grant this process AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None
