"""Compiling generated C with the system compiler, and the on-disk kernel cache.

Flags (named, never ``-march=native``: the VM masks the CPU model):
``-O3 -std=gnu11 -fPIC -shared -fopenmp -ffp-contract=fast`` plus the ISA's own
(``-mavx2 -mfma`` for avx2, and ``-mavx512f`` for avx512). No ``-ffast-math``: IEEE
semantics stay, so results depend only on the binary (FMA contraction is part of it).

Every kernel is compiled with the system headers it may use (``immintrin.h``, ``omp.h``,
``math.h``, ...) included first from a header gcc has precompiled once for those flags (kept
in the cache beside the kernels): parsing ``immintrin.h`` is most of a small kernel's compile
time (0.35 s against 0.09 s here). The code is the same either way (the headers are
include-guarded and the flags unchanged; tests/kernels/test_compiler.py compares the bytes);
where the precompiled header cannot be built or used, gcc reads the header's text instead.

A compiled kernel is cached under ``$TESSERA_KERNEL_CACHE`` (default
``~/.cache/tessera/kernels``) by a hash of its source (which names the operator, its
shapes and the schedule), the headers it may include (``csrc/*.h``), the flags and the
compiler's version.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tessera.kernels.schedule import ISAS

CSRC = Path(__file__).parent / "csrc"
COMMON_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=fast")
# the system headers generated kernels and csrc/ include (precompiled once a flag set)
PRELUDE = "".join(f"#include <{h}>\n" for h in ("immintrin.h", "math.h", "omp.h", "stdlib.h", "string.h", "time.h"))
INSTALL_HINT = "install one, e.g. `apt-get install gcc` (Debian/Ubuntu) or `dnf install gcc`, or set CC"


class CompilerError(RuntimeError):
    """No usable C compiler, or it failed on a generated kernel."""


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str

    def flags(self, isa: str) -> tuple[str, ...]:
        return COMMON_FLAGS + ISAS[isa][2]


def cache_dir() -> Path:
    env = os.environ.get("TESSERA_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tessera" / "kernels"


@functools.lru_cache(maxsize=8)
def _probe(candidate: str) -> Compiler:
    path = shutil.which(candidate)
    if path is None:
        raise CompilerError(f"C compiler {candidate!r} not found; {INSTALL_HINT}")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompilerError(f"C compiler {path} does not run ({exc}); {INSTALL_HINT}") from exc
    return Compiler(path=path, version=out.stdout.splitlines()[0].strip() if out.stdout else "unknown")


def find_compiler() -> Compiler:
    """$CC if set (and it must work), else the first of gcc, cc, clang on PATH."""
    if os.environ.get("CC"):
        return _probe(os.environ["CC"])
    for candidate in ("gcc", "cc", "clang"):
        if shutil.which(candidate):
            return _probe(candidate)
    raise CompilerError(f"no C compiler found (looked for $CC, gcc, cc, clang on PATH); {INSTALL_HINT}")


@functools.lru_cache(maxsize=1)
def _headers_text() -> str:
    """Every header a generated kernel may include, in a fixed order (read once a process)."""
    return "".join(f"// {p.name}\n{p.read_text()}" for p in sorted(CSRC.glob("*.h")))


def cache_key(source: str, compiler: Compiler, isa: str, extra_flags: tuple[str, ...] = ()) -> str:
    flags = compiler.flags(isa) + tuple(extra_flags)
    material = json.dumps({"source": source, "headers": _headers_text(), "flags": flags, "compiler": compiler.version})
    return hashlib.sha256(material.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Compiled:
    path: Path
    key: str
    compile_seconds: float  # 0.0 when it came from the cache
    cached: bool


_PRELUDE_LOCK = threading.Lock()  # the tuners compile candidates from a thread pool
_NO_PRELUDE: set[str] = set()  # flag sets gcc could not precompile for, in this process


def prelude_include(compiler: Compiler, flags: tuple[str, ...]) -> tuple[str, ...]:
    """gcc arguments that include the precompiled prelude (built here once for ``flags``, then
    renamed into place, so concurrent processes agree), or () where gcc cannot precompile it."""
    if os.environ.get("TESSERA_NO_PCH") or "clang" in compiler.version.lower():
        return ()
    tag = hashlib.sha256(json.dumps([PRELUDE, flags, compiler.path, compiler.version]).encode()).hexdigest()[:16]
    folder = cache_dir() / "pch" / tag
    with _PRELUDE_LOCK:
        if tag in _NO_PRELUDE:
            return ()
        if not (folder / "tessera_prelude.h.gch").exists():
            folder.mkdir(parents=True, exist_ok=True)
            mine = f"{os.getpid()}.{threading.get_ident()}"
            header = folder / "tessera_prelude.h"
            (folder / f".h.{mine}").write_text(PRELUDE)
            os.replace(folder / f".h.{mine}", header)  # the same text whoever writes it
            tmp = folder / f".gch.{mine}"
            cmd = [compiler.path, *flags, "-x", "c-header", str(header), "-o", str(tmp)]
            try:
                built = subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0
            except (OSError, subprocess.SubprocessError):
                built = False
            if not built:
                tmp.unlink(missing_ok=True)
                _NO_PRELUDE.add(tag)
                return ()
            os.replace(tmp, folder / "tessera_prelude.h.gch")
    return ("-I", str(folder), "-include", "tessera_prelude.h")


def compile_source(source: str, *, isa: str, name: str = "kernel", extra_flags: tuple[str, ...] = ()) -> Compiled:
    """Build ``source`` into a shared library (or find it in the cache). ``extra_flags`` come
    after the common ones, so e.g. ``-ffp-contract=off`` overrides ``=fast`` (the stencil
    tests' bit-exact builds)."""
    compiler = find_compiler()
    key = cache_key(source, compiler, isa, extra_flags)
    folder = cache_dir() / key[:2]
    lib = folder / f"{key}.so"
    if lib.exists():
        return Compiled(lib, key, 0.0, True)
    folder.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        target = Path(tmp) / "out.so"
        flags = (*compiler.flags(isa), *extra_flags)
        cmd = [compiler.path, *flags, *prelude_include(compiler, flags), "-I", str(CSRC), str(src), "-o", str(target)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CompilerError(f"{compiler.path} failed to run on {name} ({exc}); {INSTALL_HINT}") from exc
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:300])
            raise CompilerError(f"{compiler.path} failed on generated kernel {name}: {first}")
        (folder / f"{key}.c").write_text(source)
        os.replace(target, lib)
    return Compiled(lib, key, time.perf_counter() - began, False)


def load(compiled: Compiled) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(compiled.path))
    lib.tk_init.restype = None
    lib.tk_init()
    return lib
