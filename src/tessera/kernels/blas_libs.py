"""OpenBLAS, BLIS and AMD's AOCL-BLAS (a BLIS fork) as anchors, called through ctypes: SGEMM on row-major float32 arrays,
the thread count set once per library (outside any timed region), and the code path each
runs reported by the library itself.

Both libraries pick their kernels at run time from the CPU they find (OpenBLAS built with
DYNAMIC_ARCH, BLIS with its x86_64 family of sub-configurations), and both can end up on
slower ones than the CPU allows: OpenBLAS takes its AVX2 ``Haswell`` kernels wherever the
environment sets ``OPENBLAS_CORETYPE=Haswell`` (these machines' environment does), BLIS 0.9
and 0.7 fall back to their portable ``generic`` C kernels on a CPU newer than the release
(an AVX-512 AMD EPYC of family 0x1A here). So each is loaded with the kernel set of the widest ISA this CPU has (``OPENBLAS_CORETYPE=SkylakeX``,
``BLIS_ARCH_TYPE`` = the id of ``skx``) unless told ``kernel_set="auto"``, and the report
gives both: what the library detected alone (probed in a child process) and what it ran.

Where they come from: OpenBLAS from the ``scipy-openblas32`` / ``scipy-openblas64`` wheels
(extra ``tessera[anchors]``); BLIS from Debian's ``libblis4-openmp`` (multi-threaded, with
the ``skx``/``zen3``/``haswell`` kernels), else the ``blis`` wheel's single-threaded copy;
AOCL-BLAS from the ``aoclda`` wheel (AMD's data-analytics library, which ships it with
``zen4``/``zen5`` kernels and its own OpenMP runtime; nothing else of it is used).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the scipy-openblas wheels: (module, symbol suffix, integer type of the interface)
_OPENBLAS_WHEELS = (("scipy_openblas32", "", ctypes.c_int), ("scipy_openblas64", "64_", ctypes.c_int64))
_BLIS_SYSTEM = tuple(
    f"/usr/lib/x86_64-linux-gnu/blis-{t}/libblis.so.4" for t in ("openmp", "pthread", "serial")
)
# CBLAS enums and BLIS's trans_t
_ROW_MAJOR, _NO_TRANS, _BLIS_NO_TRANSPOSE = 101, 111, 0


class AnchorAbsent(RuntimeError):
    """An anchor library that cannot run here; the message says why and how to get it."""


@dataclass
class BlasLibrary:
    name: str  # "openblas" | "blis"
    path: str
    # prepare(A, B, C) -> a call computing C = A @ B (row-major float32, arrays kept alive by the
    # caller), its ctypes arguments converted once so the call costs only the library's time
    prepare: Callable[[np.ndarray, np.ndarray, np.ndarray], Callable[[], None]]
    set_threads: Callable[[int], None]
    max_threads: int | None  # None: as many as asked; 1 for a single-threaded build
    code_path: dict = field(default_factory=dict)


def _cpu_has_avx512() -> bool:
    from tessera.kernels.machine import cpu_isas

    return "avx512" in cpu_isas()


def _probe(code: str, env: dict[str, str | None]) -> dict:
    """Run ``code`` (which prints one JSON line) in a fresh interpreter with ``env`` changed
    (None: unset): a library decides its kernel set once, at load, so what it picks alone is
    asked of a process of its own."""
    child_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    run = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=60
    )
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1][:200]}
    return json.loads(run.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``name=value`` in this process's environment for the block (nothing when None)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


# ---- OpenBLAS ----------------------------------------------------------------------------
def _openblas_wheel() -> tuple[str, str, type]:
    for module, suffix, int_t in _OPENBLAS_WHEELS:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            continue
        # found, not imported: importing the wheel's package loads the library before the
        # kernel set can be chosen
        lib = next(Path(spec.submodule_search_locations[0], "lib").glob("libscipy_openblas*.so"), None)
        if lib is not None:
            return str(lib), suffix, int_t
    raise AnchorAbsent(
        "OpenBLAS: no scipy-openblas wheel installed (pip install -c constraints.txt -e '.[anchors]')"
    )


_OPENBLAS_PROBE = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else {path!r})
for f in ("config", "corename"):
    getattr(lib, "scipy_openblas_get_" + f + {suffix!r}).restype = ctypes.c_char_p
print(json.dumps({{"corename": lib.scipy_openblas_get_corename{suffix}().decode(),
                  "config": lib.scipy_openblas_get_config{suffix}().decode()}}))
"""


def openblas(kernel_set: str = "widest") -> BlasLibrary:
    """OpenBLAS from a scipy-openblas wheel. ``kernel_set``: "widest" (SkylakeX kernels where
    the CPU has AVX-512), "auto" (the library's own pick) or an ``OPENBLAS_CORETYPE`` name."""
    path, suffix, int_t = _openblas_wheel()
    probe = _OPENBLAS_PROBE.format(path=path, suffix=suffix)
    detected = _probe(probe, {"OPENBLAS_CORETYPE": None})
    forced = {"widest": "SkylakeX" if _cpu_has_avx512() else None, "auto": None}.get(kernel_set, kernel_set)
    if kernel_set not in ("widest", "auto"):
        took = _probe(probe, {"OPENBLAS_CORETYPE": forced}).get("corename", "")
        if took.lower() != forced.lower():
            raise ValueError(
                f"OpenBLAS kernel set {forced!r} was not taken by {Path(path).name} (it ran {took!r})"
            )
    with _env("OPENBLAS_CORETYPE", forced):  # read by the library's constructor, once per process
        lib = ctypes.CDLL(path)
    get = {f: getattr(lib, f"scipy_openblas_get_{f}{suffix}") for f in ("config", "corename")}
    for fn in get.values():
        fn.restype = ctypes.c_char_p
    sgemm_fn = getattr(lib, f"scipy_cblas_sgemm{suffix}")
    set_threads_fn = getattr(lib, f"scipy_openblas_set_num_threads{suffix}")
    set_threads_fn.argtypes = [ctypes.c_int]  # an int in both interfaces

    def prepare(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> Callable[[], None]:
        (m, k), n = a.shape, b.shape[1]
        ints = [ctypes.c_int(v) for v in (_ROW_MAJOR, _NO_TRANS, _NO_TRANS)]
        args = (
            *ints,
            *(int_t(v) for v in (m, n, k)),
            ctypes.c_float(1.0),
            ctypes.c_void_p(a.ctypes.data),
            int_t(k),
            ctypes.c_void_p(b.ctypes.data),
            int_t(n),
            ctypes.c_float(0.0),
            ctypes.c_void_p(c.ctypes.data),
            int_t(n),
        )
        return lambda arrays=(a, b, c): sgemm_fn(*args)  # the arrays live as long as the call

    code_path = {
        "library": Path(path).name,
        # what the library picks with OPENBLAS_CORETYPE unset, and what this environment sets
        "detected_alone": detected.get("corename", detected.get("error")),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
        "forced": f"OPENBLAS_CORETYPE={forced}" if forced else None,
        "corename": get["corename"]().decode(),
        "config": get["config"]().decode(),
    }
    return BlasLibrary("openblas", path, prepare, set_threads_fn, None, code_path)


# ---- BLIS and AMD's AOCL-BLAS (a BLIS fork) ----------------------------------------------
def _blis_path() -> tuple[str, list[str], bool]:
    """(library, libraries to load first, is the blis wheel's copy): Debian's libblis first
    (threaded, newer kernels)."""
    for path in _BLIS_SYSTEM:
        if os.path.exists(path):
            return path, [], False
    found = ctypes.util.find_library("blis")
    if found:
        return found, [], False
    spec = importlib.util.find_spec("blis")
    if spec is not None:
        cy = next(Path(spec.origin).parent.glob("cy.*.so"), None)
        if cy is not None:
            return str(cy), [], True
    raise AnchorAbsent(
        "BLIS: neither Debian's libblis (apt-get install libblis4-openmp) nor the blis wheel is installed"
    )


def _aocl_path() -> tuple[str, list[str], bool]:
    """AMD's AOCL-BLAS as the aoclda wheel ships it (multi-threaded, with its OpenMP runtime,
    which the library does not find by itself: it is loaded first)."""
    spec = importlib.util.find_spec("aoclda")
    libs = Path(spec.origin).parent.parent / "aoclda.libs" if spec is not None and spec.origin else None
    blis_mt = next(libs.glob("libblis-mt-*.so*"), None) if libs and libs.exists() else None
    if blis_mt is None:
        raise AnchorAbsent(
            "AOCL-BLAS: the aoclda wheel is not installed (pip install -c constraints.txt -e '.[aocl]')"
        )
    return str(blis_mt), [str(p) for p in libs.glob("libomp-*.so*")], False


_BLIS_PROBE = """
import ctypes, json
for pre in {preload!r}:
    ctypes.CDLL(pre)
lib = ctypes.CDLL({path!r})
lib.bli_init()
lib.bli_arch_string.restype = ctypes.c_char_p
names = []  # arch_t's names in order; "generic" is the enum's last
while len(names) < 64 and (not names or names[-1] != "generic"):
    name = lib.bli_arch_string(len(names))
    names.append(name.decode() if name else "")
i = lib.bli_arch_query_id()
print(json.dumps({{"arch": lib.bli_arch_string(i).decode(), "arch_names": names}}))
"""
# sub-configurations whose kernels use AVX-512
_AVX512_ARCHS = {"skx", "knl", "zen4", "zen5"}


def _blis_preferences() -> list[str]:
    from tessera.kernels.machine import cpu_flags

    amd = (
        "AuthenticAMD" in Path("/proc/cpuinfo").read_text()[:2000]
        if Path("/proc/cpuinfo").exists()
        else False
    )
    wide = (["zen5", "zen4", "skx"] if amd else ["skx", "zen4", "zen5"]) if "avx512f" in cpu_flags() else []
    return [*wide, "zen3", "zen2", "zen", "haswell"]


def _blis_arch(path: str, preload: list[str], kernel_set: str) -> tuple[str | None, dict]:
    """The BLIS_ARCH_TYPE setting to force ("VALUE (name)"; None: the library's own pick),
    and what it picks alone. "widest" keeps the library's pick when that already uses the widest ISA here
    (AOCL-BLAS finds zen5 itself) and otherwise forces the first sub-configuration of
    _blis_preferences() the build has. A forced one the build lacks makes BLIS abort the
    process, so each is tried in a child first, by arch_t id, then by name."""

    def probe(value):
        return _probe(_BLIS_PROBE.format(path=path, preload=preload), {"BLIS_ARCH_TYPE": value})

    detected = probe(None)
    ids = {name: i for i, name in enumerate(detected.get("arch_names", [])) if name}
    if kernel_set == "auto" or not ids:
        return None, detected
    if kernel_set != "widest":
        if kernel_set not in ids:
            raise ValueError(f"BLIS kernel set {kernel_set!r} is not one of {path}'s: {sorted(ids)}")
        wanted = [kernel_set]
    else:
        own = detected.get("arch")
        if own in _AVX512_ARCHS or (own not in (None, "generic") and not _cpu_has_avx512()):
            return None, detected
        wanted = _blis_preferences()
    for name in (n for n in wanted if n in ids):
        for value in (str(ids[name]), name):  # BLIS 0.9 reads a number (atoi), AOCL-BLAS a name too
            if probe(value).get("arch") == name:
                return f"{value} ({name})", detected
    if kernel_set != "widest":
        raise ValueError(
            f"BLIS kernel set {kernel_set!r} is not built into {path} (BLIS aborts when it is forced)"
        )
    return None, detected


def blis(kernel_set: str = "widest", *, flavour: str = "blis") -> BlasLibrary:
    """BLIS through its typed API (``bli_sgemm``); ``flavour`` "blis" (the reference BLIS) or
    "aocl_blis" (AMD's). ``kernel_set``: "widest" (see _blis_arch), "auto" (its own pick) or a
    sub-configuration name."""
    path, preload, wheel = _blis_path() if flavour == "blis" else _aocl_path()
    if wheel and kernel_set not in ("widest", "auto"):
        raise ValueError(
            f"BLIS kernel set {kernel_set!r}: the blis wheel's BLIS (0.7) cannot be told one (use 'auto')"
        )
    forced, detected = (
        (None, _probe(_BLIS_PROBE.format(path=path, preload=preload), {"BLIS_ARCH_TYPE": None}))
        if wheel
        else _blis_arch(path, preload, kernel_set)
    )
    for pre in preload:
        ctypes.CDLL(pre)
    with _env("BLIS_ARCH_TYPE", forced.split(" ")[0] if forced else None):
        lib = ctypes.CDLL(path)
        lib.bli_init()  # the arch is chosen here, once per process
        lib.bli_arch_query_id()
    lib.bli_arch_string.restype = ctypes.c_char_p
    lib.bli_info_get_version_str.restype = ctypes.c_char_p
    lib.bli_info_get_int_type_size.restype = ctypes.c_int64
    dim_t = ctypes.c_int64 if lib.bli_info_get_int_type_size() == 64 else ctypes.c_int32

    def prepare(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> Callable[[], None]:
        (m, k), n = a.shape, b.shape[1]
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha, beta: passed by address
        no, d = ctypes.c_int(_BLIS_NO_TRANSPOSE), dim_t
        ptr = ctypes.c_void_p
        args = (no, no, d(m), d(n), d(k), ctypes.byref(one), ptr(a.ctypes.data), d(k), d(1),
                ptr(b.ctypes.data), d(n), d(1), ctypes.byref(zero), ptr(c.ctypes.data), d(n), d(1))  # fmt: skip
        return lambda arrays=(a, b, c): lib.bli_sgemm(*args)  # the arrays live as long as the call

    threaded = bool(lib.bli_info_get_enable_openmp() or lib.bli_info_get_enable_pthreads())

    def set_threads(threads: int) -> None:
        if threaded:
            lib.bli_thread_set_num_threads.argtypes = [dim_t]
            lib.bli_thread_set_num_threads(threads)

    code_path = {
        "library": path if not wheel else "blis wheel (cython-blis) " + Path(path).name,
        "version": lib.bli_info_get_version_str().decode(),
        "detected_alone": detected.get("arch", detected.get("error")),
        "forced": f"BLIS_ARCH_TYPE={forced}" if forced is not None else None,
        "arch": lib.bli_arch_string(lib.bli_arch_query_id()).decode(),
        "threading": "openmp" if lib.bli_info_get_enable_openmp() else "pthreads" if threaded else "none",
    }
    return BlasLibrary(flavour, path, prepare, set_threads, None if threaded else 1, code_path)


def load(name: str, kernel_set: str = "widest") -> BlasLibrary:
    """``name`` "openblas", "blis" or "aocl_blis"; raises AnchorAbsent saying why it cannot run."""
    loaders = {"openblas": openblas, "blis": blis, "aocl_blis": lambda ks: blis(ks, flavour="aocl_blis")}
    if name not in loaders:
        raise ValueError(f"unknown BLAS anchor {name!r}; expected one of {sorted(loaders)}")
    try:
        return loaders[name](kernel_set)
    except AnchorAbsent:
        raise
    except (OSError, AttributeError) as exc:  # a library that loads but lacks a symbol we call
        raise AnchorAbsent(f"{name}: {type(exc).__name__}: {exc}") from exc
