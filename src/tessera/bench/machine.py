"""`tessera bench machine`: the measured parameters of the kernels' performance model — FP32
FMA peak per ISA and thread count, streaming read bandwidth of L1 / L2 / L3 / DRAM and
DRAM write bandwidth (``tessera.kernels.machine``) — written as machine.json / .md / .png
and saved where the tuner reads them."""

from __future__ import annotations

from pathlib import Path

from tessera.bench.harness import BenchResult, matmul_peak_flops
from tessera.kernels.machine import LEVELS, Machine, measure, save_machine

GIGA = 1e9


def machine_rows(m: Machine) -> list[dict]:
    rows = []
    for isa, table in m.peak_flops.items():
        for t, flops in sorted(table.items()):
            rows.append({"what": f"FP32 FMA peak ({isa})", "threads": t, "value": round(flops / GIGA, 2), "unit": "GFLOP/s"})
    for level in LEVELS:
        for t, bw in sorted(m.read_bw[level].items()):
            size = m.cache_bytes.get(level)
            label = f"read {level}" + (f" ({size >> 10} KiB)" if size else "")
            rows.append({"what": label, "threads": t, "value": round(bw / GIGA, 2), "unit": "GB/s"})
    for t, bw in sorted(m.write_bw.items()):
        rows.append({"what": "write DRAM", "threads": t, "value": round(bw / GIGA, 2), "unit": "GB/s"})
    for isa, tiles in m.ukernel_flops.items():  # the micro-kernel in its inner loops, kc = 256
        for tile, by_kc in tiles.items():
            rate = by_kc.get(256, max(by_kc.values()))
            rows.append({"what": f"micro-kernel {isa} {tile} kc256", "threads": 1, "value": round(rate / GIGA, 2),
                         "unit": "GFLOP/s"})
    return rows


def run_machine_bench(*, quick: bool) -> BenchResult:
    m = measure(seconds=0.05 if quick else 0.5)
    save_machine(m)
    torch_rate = matmul_peak_flops(threads=1)
    headline = {
        "isa": m.isa,
        "peak_gflops_1_thread": round(m.peak(1) / GIGA, 2),
        f"peak_gflops_{m.cores}_threads": round(m.peak(m.cores) / GIGA, 2),
        "dram_read_gbs_1_thread": round(m.bandwidth("DRAM", 1) / GIGA, 2),
        "torch_matmul_gflops_1_thread": round(torch_rate / GIGA, 2),
    }
    notes = [
        f"CPU {m.cpu!r}, {m.cores} cores, ISAs {', '.join(m.isas)}; caches from /sys: "
        + ", ".join(f"{k} {v >> 10} KiB (shared by {m.cache_shared_by[k]})" for k, v in m.cache_bytes.items()),
        "Peak: independent FMA chains per thread (more than latency x pipes); bandwidth: vector reads of a "
        "buffer of half the level per thread (L3: split among the threads that share it), best round.",
        f"torch's 512^3 matmul on 1 thread for comparison: {torch_rate / GIGA:.1f} GFLOP/s.",
        f"Measured in {m.measured_seconds:.1f} s; saved for the tuner (fingerprint {m.fingerprint}).",
    ]
    return BenchResult(name="machine", headline=headline, rows=machine_rows(m),
                       columns=["what", "threads", "value", "unit"], notes=notes, extra={"parameters": m.to_json()})


def plot_machine(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    peaks = [r for r in result.rows if r["what"].startswith("FP32 FMA peak")]
    ax1.bar([f"{r['what'].split('(')[1][:-1]}\n{r['threads']}t" for r in peaks], [r["value"] for r in peaks])
    ax1.set_ylabel("GFLOP/s")
    ax1.set_title("FP32 FMA peak")
    reads = [r for r in result.rows if r["what"].startswith("read")]
    for t in sorted({r["threads"] for r in reads}):
        sel = [r for r in reads if r["threads"] == t]
        ax2.plot([r["what"].split()[1] for r in sel], [r["value"] for r in sel], marker="o", label=f"{t} thread(s)")
    ax2.set_yscale("log")
    ax2.set_ylabel("GB/s")
    ax2.set_title("streaming read bandwidth")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def plot_roofline(result: BenchResult, path: Path) -> None:
    """`tessera bench kernels`' figure: the measured roofs (FMA peak, L3 and DRAM bandwidth on
    1 thread) and every kernel's point (1 thread: Tessera and each anchor), plus the ResNet-8
    loss curves when the run has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = Machine.from_json(result.extra["machine_parameters"])
    curves = result.extra.get("training")
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else 7, 5), squeeze=False)
    ax = axes[0][0]
    rows = [r for r in result.rows if r["threads"] == 1]
    lo = min([r["intensity"] for r in rows] + [1.0]) / 2
    hi = max([r["intensity"] for r in rows] + [100.0]) * 2
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    peak = params.peak(1) / GIGA
    for level, style in (("L3", ":"), ("DRAM", "--")):
        bw = params.bandwidth(level, 1) / GIGA
        ax.plot(xs, [min(peak, bw * x) for x in xs], style, color="gray", label=f"roof: {level} {bw:.0f} GB/s")
    ax.axhline(peak, color="black", lw=1, label=f"FMA peak {peak:.0f} GFLOP/s ({params.isa})")
    for key, marker, label in (("gflops", "o", "Tessera"), ("openblas_gflops", "v", "OpenBLAS"),
                               ("blis_gflops", "D", "BLIS"), ("aocl_blis_gflops", "P", "AOCL-BLAS"),
                               ("torch_gflops", "s", "torch (best path)"),
                               ("tvm_gflops", "x", "TVM"), ("numpy_gflops", "^", "numpy (sanity)")):
        pts = [(r["intensity"], r[key]) for r in rows if r.get(key)]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, label=label, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of inputs + output)")
    ax.set_ylabel("GFLOP/s, 1 thread")
    ax.set_title("SGEMM (square, transformer, odd) and ResNet-50 convs on the measured roofline")
    ax.legend(fontsize=7)
    if curves:
        ax = axes[0][1]
        for name, values in curves["losses"].items():
            ax.plot(values, label=name, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.set_title(f"ResNet-8 on digits (max gap {curves['max_abs_gap']:.1e})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
