"""The machine the performance model describes: measured, not assumed.

Cache sizes come from the OS (/sys/devices/system/cpu/cpu0/cache); the vector ISAs from
the CPU flags the kernel reports; peak FP32 FMA throughput and the streaming bandwidth of
each level (L1, L2, L3, DRAM) from the bundled micro-benchmark ``csrc/machine_bench.c``,
on 1 thread and on every core; each register tile's micro-kernel rate at several block
depths from ``csrc/ukernel_bench.c``. The result is kept as JSON beside the kernel cache, keyed by
a fingerprint of the CPU, so the tuner measures a machine once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tessera.kernels.compiler import CSRC, cache_dir, compile_source
from tessera.kernels.schedule import ISAS, REGISTER_TILES

SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
LEVELS = ("L1", "L2", "L3", "DRAM")
FALLBACK_CACHES = {"L1": 32 << 10, "L2": 1 << 20, "L3": 16 << 20}  # only where /sys has none


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (``cpuinfo``: its text, else read here;
    empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> set[str]:
    return set(cpu_fields().get("flags", "").split())


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU by name, family/model and widest vector ISA flag, e.g. "AMD EPYC (family 25,
    model 1; avx2)": the project's machines change from one session to the next, AVX-512 or
    not, and a benchmark's ratios only compare with another run's on the same kind."""
    fields = cpu_fields(cpuinfo)
    flags = set(fields.get("flags", "").split())
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse2") if f in flags), "scalar")
    name = fields.get("model name") or platform.processor() or platform.machine()
    family, model = fields.get("cpu family"), fields.get("model")
    where = f"family {family}, model {model}; " if family and model else ""
    return f"{name} ({where}{isa})"


def cpu_isas(flags: set[str] | None = None) -> list[str]:
    """The vector ISAs the kernels can use here, widest last."""
    flags = cpu_flags() if flags is None else flags
    out = []
    if {"avx2", "fma"} <= flags:
        out.append("avx2")
        if "avx512f" in flags:
            out.append("avx512")
    return out


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(text.rstrip("KMG")) * scale


def _cpu_count(cpu_list: str) -> int:
    count = 0
    for part in cpu_list.strip().split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def cache_sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(bytes per level, cores sharing each level) for L1 data, L2 and L3."""
    sizes, shared = dict(FALLBACK_CACHES), {"L1": 1, "L2": 1, "L3": os.cpu_count() or 1}
    for index in sorted(SYS_CACHE.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            if kind == "Instruction" or level > 3:
                continue
            sizes[f"L{level}"] = _size((index / "size").read_text())
            shared[f"L{level}"] = _cpu_count((index / "shared_cpu_list").read_text())
        except (OSError, ValueError):
            continue
    return sizes, shared


@dataclass(frozen=True, kw_only=True)
class Machine:
    isa: str
    cores: int
    cache_bytes: dict[str, int]
    cache_shared_by: dict[str, int]
    peak_flops: dict[str, dict[int, float]]  # ISA -> threads -> FP32 FLOP/s of all of them together
    read_bw: dict[str, dict[int, float]]  # level -> threads -> bytes/s of all of them together
    write_bw: dict[int, float]  # DRAM stores, threads -> bytes/s
    cpu: str = ""
    measured_seconds: float = 0.0
    fingerprint: str = ""
    isas: tuple[str, ...] = field(default=())
    # ISA -> "MRxNR|inner order" -> kc -> FLOP/s of the micro-kernel in its inner loops, one thread
    ukernel_flops: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)

    def peak(self, threads: int, isa: str | None = None) -> float:
        table = self.peak_flops[isa or self.isa]
        if threads in table:
            return table[threads]
        return table[1] * threads if threads < max(table) else table[max(table)]

    def bandwidth(self, level: str, threads: int) -> float:
        table = self.read_bw[level]
        return table[min(threads, max(table))]

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> Machine:
        data = dict(data)
        data["peak_flops"] = {i: {int(k): v for k, v in t.items()} for i, t in data["peak_flops"].items()}
        data["read_bw"] = {lvl: {int(k): v for k, v in t.items()} for lvl, t in data["read_bw"].items()}
        data["write_bw"] = {int(k): v for k, v in data["write_bw"].items()}
        data["isas"] = tuple(data.get("isas", ()))
        data["ukernel_flops"] = {
            isa: {tile: {int(k): v for k, v in t.items()} for tile, t in tiles.items()}
            for isa, tiles in data.get("ukernel_flops", {}).items()
        }
        return Machine(**data)


def fingerprint() -> str:
    sizes, shared = cache_sizes()
    text = json.dumps([platform.processor(), sorted(cpu_flags()), os.cpu_count(), sizes, shared])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def _bench_lib(isa: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(probe_library(isa))
    lib.tk_peak_gflops.restype = ctypes.c_double
    lib.tk_peak_gflops.argtypes = [ctypes.c_int, ctypes.c_double]
    for fn in (lib.tk_read_gbps, lib.tk_write_gbps):
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_double]
    lib.tk_streams_read_gbps.restype = ctypes.c_double
    lib.tk_streams_read_gbps.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_double]
    lib.tk_stream_gbps.restype = ctypes.c_double
    lib.tk_stream_gbps.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_double]
    lib.tk_arrays_seconds.restype = ctypes.c_double
    lib.tk_arrays_seconds.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int,
                                      ctypes.c_long, ctypes.c_int]
    return lib


UKERNEL_KCS = (64, 128, 256, 512)


def _ukernel_lib(isa: str, mr: int, nr: int) -> ctypes.CDLL:
    defines = f"#define TK_VEC {256 if isa == 'avx2' else 512}\n#define TK_MR {mr}\n#define TK_NR {nr}\n#define TK_UNROLL 4\n"
    source = defines + (CSRC / "ukernel_bench.c").read_text()
    lib = ctypes.CDLL(str(compile_source(source, isa=isa, name=f"ukernel_{isa}_{mr}x{nr}").path))
    lib.tk_ukernel_gflops.restype = ctypes.c_double
    lib.tk_ukernel_gflops.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_double]
    return lib


def measure_ukernels(isas: list[str], seconds: float) -> dict[str, dict[str, dict[int, float]]]:
    """Each register tile's micro-kernel rate in its inner loops (both orders), one thread, at
    the block depths kc the space uses: the tensorized primitive measured, as swDNN measures
    its building blocks. Key "MRxNR|inner"."""
    from concurrent.futures import ThreadPoolExecutor

    tiles = [(isa, mr, nr) for isa in isas for mr, nr in REGISTER_TILES[isa]]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # compiles only
        libs = list(pool.map(lambda t: _ukernel_lib(*t), tiles))
    out: dict[str, dict[str, dict[int, float]]] = {}
    for (isa, mr, nr), lib in zip(tiles, libs, strict=True):
        for inner, ir_outer in (("jr,ir", 0), ("ir,jr", 1)):
            out.setdefault(isa, {})[f"{mr}x{nr}|{inner}"] = {
                kc: lib.tk_ukernel_gflops(kc, ir_outer, seconds) * 1e9 for kc in UKERNEL_KCS}
    return out


def measure(*, isa: str | None = None, seconds: float = 0.3, threads: tuple[int, ...] | None = None) -> Machine:
    """Run the micro-benchmark (about 12 x ``seconds`` per thread count)."""
    isas = cpu_isas()
    if not isas:
        raise RuntimeError("this CPU has neither AVX2+FMA nor AVX-512; Tessera's kernels need one of them")
    isa = isa or isas[-1]
    if isa not in ISAS or isa not in isas:
        raise ValueError(f"ISA {isa!r} is not available here (available: {', '.join(isas)})")
    began = time.perf_counter()
    cores = os.cpu_count() or 1
    threads = threads or tuple(sorted({1, cores}))
    sizes, shared = cache_sizes()
    peak = {}
    for name in isas:  # every ISA's peak: a schedule may use the narrower one
        bench = _bench_lib(name)
        peak[name] = {t: bench.tk_peak_gflops(t, seconds) * 1e9 for t in threads}
    lib = _bench_lib(isa)
    read_bw: dict[str, dict[int, float]] = {}
    for level in LEVELS:
        read_bw[level] = {}
        for t in threads:
            if level == "DRAM":
                per_thread = max(4 * sizes["L3"], 256 << 20) // t
            else:  # half the level, split among the threads that share it
                per_thread = sizes[level] // 2 // max(1, min(t, shared[level]))
            read_bw[level][t] = lib.tk_read_gbps(per_thread, t, seconds) * 1e9
    ukernels = measure_ukernels(isas, seconds / 8)
    dram = max(4 * sizes["L3"], 256 << 20)
    write_bw = {t: lib.tk_write_gbps(dram // t, t, seconds) * 1e9 for t in threads}
    return Machine(
        isa=isa, cores=cores, cache_bytes=sizes, cache_shared_by=shared, peak_flops=peak,
        read_bw=read_bw, write_bw=write_bw, cpu=platform.processor() or platform.machine(),
        measured_seconds=time.perf_counter() - began, fingerprint=fingerprint(), isas=tuple(isas),
        ukernel_flops=ukernels,
    )


def available_memory_bytes() -> int:
    """The kernel's MemAvailable (0 where /proc/meminfo has none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def dram_buffer_bytes(sizes: dict) -> int:
    """Bytes a DRAM benchmark streams through: far past the last-level cache this VM
    reports (a host's cache can be larger than the guest is told; 256 MiB read 8 streams
    at 84 GB/s here, 4 GiB at 71), 32x the LLC, but at most a quarter of the memory
    available now (an Intel VM reporting a 480 MiB L3 asked 15 GiB of a 24 GiB machine,
    and a benchmark holding 9 GiB of stencil arrays beside it was killed); 1 GiB at least."""
    room = available_memory_bytes() // 4 or 32 * sizes["L3"]
    return max(min(32 * sizes["L3"], room), 1 << 30)


def peak_flops(threads: int, *, seconds: float = 0.3, isa: str | None = None) -> float:
    """FP32 FMA FLOP/s of ``threads`` threads, measured now with ``measure``'s micro-benchmark
    (a benchmark's compute bound from its own run, on the cores its process may use)."""
    return _bench_lib(isa or cpu_isas()[-1]).tk_peak_gflops(threads, seconds) * 1e9


def dram_bandwidth(threads: int, *, seconds: float = 0.3, isa: str | None = None) -> tuple[float, float]:
    """(read, write) DRAM bytes/s on ``threads`` threads, measured now with the same
    micro-benchmark as ``measure`` (a benchmark's roofline from its own quiet run)."""
    isa = isa or cpu_isas()[-1]
    sizes, _ = cache_sizes()
    total = dram_buffer_bytes(sizes)
    lib = _bench_lib(isa)
    return (lib.tk_read_gbps(total // threads, threads, seconds) * 1e9,
            lib.tk_write_gbps(total // threads, threads, seconds) * 1e9)


STREAM_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def dram_streams_read_bandwidth(
    threads: int, *, seconds: float = 0.3, isa: str | None = None
) -> dict[int, float]:
    """DRAM read bytes/s on ``threads`` threads when each reads that many arrays at once
    (a variable-coefficient stencil reads one per point): the many-stream figure is the
    bandwidth such kernels can attain, which one stream alone under-measures."""
    isa = isa or cpu_isas()[-1]
    sizes, _ = cache_sizes()
    total = dram_buffer_bytes(sizes)
    lib = _bench_lib(isa)
    return {k: lib.tk_streams_read_gbps(total // threads, threads, k, seconds) * 1e9 for k in STREAM_COUNTS}


PROBE_STREAMS = (8, 16)  # where the full sweep of stream counts peaks on this VM


def dram_probe(threads: int, *, seconds: float = 0.15, isa: str | None = None) -> tuple[float, float]:
    """(read, write) DRAM bytes/s right now on freshly allocated buffers: the read as the best
    of ``PROBE_STREAMS`` arrays at once over the same buffer as
    ``dram_streams_read_bandwidth``, in about a second. This VM's bandwidth drifts, so a
    benchmark can log one beside its kernels to show the drift (a kernel's roofline is timed
    on its own buffers instead: ``arrays_stream_seconds``)."""
    isa = isa or cpu_isas()[-1]
    total = dram_buffer_bytes(cache_sizes()[0])
    lib = _bench_lib(isa)
    read = max(lib.tk_streams_read_gbps(total // threads, threads, k, seconds) for k in PROBE_STREAMS)
    return read * 1e9, lib.tk_write_gbps(total // threads, threads, seconds) * 1e9


STREAM_KERNELS = {"copy": (0, 0), "copy_nt": (0, 1), "triad": (1, 0), "triad_nt": (1, 1)}


def stream_probe(threads: int, *, seconds: float = 0.2, isa: str | None = None,
                 total_bytes: int | None = None) -> dict[str, float]:
    """A STREAM-class probe (McCalpin's copy and triad, counted as STREAM counts them: no
    write-allocate traffic), with plain and with non-temporal stores, each on three arrays far
    larger than the last-level cache, best round of ``seconds``: bytes/s of each, and
    ``best``. The roofline a stencil's bandwidth is compared with in the HPC literature,
    beside Tessera's own-buffer probe. ``total_bytes``: the three arrays of all threads
    together (default ``dram_buffer_bytes``)."""
    isa = isa or cpu_isas()[-1]
    per_array = (total_bytes or dram_buffer_bytes(cache_sizes()[0])) // threads // 3
    lib = _bench_lib(isa)
    out = {name: lib.tk_stream_gbps(kind, nt, per_array, threads, seconds) * 1e9
           for name, (kind, nt) in STREAM_KERNELS.items()}
    out["best"] = max(out.values())
    return out


def probe_library(isa: str | None = None) -> str:
    """Path of the compiled micro-benchmark (``tk_arrays_seconds`` and the others), for a
    process that loads it without Tessera (the Devito worker)."""
    isa = isa or cpu_isas()[-1]
    source = f"#define TK_VEC {256 if isa == 'avx2' else 512}\n" + (CSRC / "machine_bench.c").read_text()
    return str(compile_source(source, isa=isa, name="machine_bench").path)


def arrays_stream_seconds(out, arrays, count: int, threads: int, *, group: int = 16, run: int = 1024,
                          isa: str | None = None) -> float:
    """Seconds of one pass that reads the first ``count`` float32s of each array (numpy,
    C-contiguous), ``group`` at a time and ``run`` floats of each in turn, and writes
    ``count`` of ``out``: a sweep's ideal traffic timed on its own buffers (their pages'
    placement included)."""
    if run < 128 or run % 128:
        raise ValueError(f"run={run} must be a positive multiple of 128 floats (8 vectors of 16)")
    for a in (out, *arrays):
        if a.dtype.name != "float32" or not a.flags.c_contiguous or a.size < count:
            raise ValueError(f"arrays must be C-contiguous float32 with at least {count} elements; got {a.dtype} "
                             f"{a.shape}")
    ptrs = (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))
    lib = _bench_lib(isa or cpu_isas()[-1])
    return lib.tk_arrays_seconds(out.ctypes.data, ptrs, len(arrays), count, group, run, threads)


def machine_path() -> Path:
    return cache_dir() / f"machine-v2-{fingerprint()}.json"  # v2: with the micro-kernel rates


def load_machine(*, measure_if_missing: bool = True, seconds: float = 0.3) -> Machine:
    """This machine's parameters: from the cache, else measured now (and saved)."""
    path = machine_path()
    if path.exists():
        return Machine.from_json(json.loads(path.read_text()))
    if not measure_if_missing:
        raise FileNotFoundError(f"no machine parameters at {path}; run `tessera bench machine`")
    m = measure(seconds=seconds)
    save_machine(m)
    return m


def save_machine(m: Machine) -> Path:
    path = machine_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(m.to_json(), indent=2))
    os.replace(partial, path)
    return path
