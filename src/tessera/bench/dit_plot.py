"""The picture of `tessera bench dit`: speedups by size, bytes against the formulas, speedups
on emulated links, and the stale methods' error growing step by step."""

from __future__ import annotations

from pathlib import Path

from tessera.bench.harness import BenchResult


def plot_dit(result: BenchResult, path: Path, methods: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    _speedups(axes[0][0], result, methods)
    _bytes(axes[0][1], result)
    _links(axes[1][0], result, methods)
    _fidelity(axes[1][1], result)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _speedups(ax, result: BenchResult, methods: list[str]) -> None:
    sizes = sorted({r["tokens"] for r in result.rows})
    for method in methods:
        points = sorted((r["tokens"], r["speedup"]) for r in result.rows if r["method"] == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.axhline(2.0, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="image tokens", ylabel="speedup over serial (2 ranks)", title="Loopback (no link model)")
    ax.set_xticks(sizes)
    ax.legend(fontsize=8)


def _bytes(ax, result: BenchResult) -> None:
    largest_tokens = max(r["tokens"] for r in result.rows)
    largest = [r for r in result.rows if r["tokens"] == largest_tokens and r["method"] != "serial"]
    xs = range(len(largest))
    ax.bar([x - 0.2 for x in xs], [r["bytes_per_step"] / 2**20 for r in largest], width=0.4, label="measured")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["formula_bytes_per_step"] / 2**20 for r in largest],
        width=0.4,
        label="formula",
    )
    ax.set_xticks(list(xs), [r["method"] for r in largest], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="MiB per step, all ranks", title=f"Communication at {largest[0]['size']} latent")
    ax.set_yscale("log")
    ax.legend(fontsize=8)


def _links(ax, result: BenchResult, methods: list[str]) -> None:
    rows = result.extra.get("link_rows", [])
    links = list(dict.fromkeys(r["link"] for r in rows))
    if not links:
        ax.set_title("no emulated links in this run")
        ax.axis("off")
        return
    width = 0.8 / len(links)
    for i, link in enumerate(links):
        speed = {r["method"]: r["speedup"] for r in rows if r["link"] == link}
        xs = [m + (i - (len(links) - 1) / 2) * width for m in range(len(methods))]
        ax.bar(xs, [speed.get(m, 0) for m in methods], width=width, label=link)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=8)
    scale = result.extra.get("link_scaling", {})
    ax.set(
        ylabel="speedup over serial",
        title=f"Emulated links, scaled to {scale.get('device', '?')} compute ({rows[0]['size']} latent)",
    )
    ax.legend(fontsize=8)


def _fidelity(ax, result: BenchResult) -> None:
    rows = [r for r in result.extra.get("fidelity", []) if r["method"] != "serial"]
    if not rows:
        ax.set_title("fidelity skipped (no trained digits checkpoint)")
        ax.axis("off")
        return
    for r in rows:
        style = "-" if r["method"].startswith("pipefusion") else "--"
        steps = range(1, len(r["trajectory_rel_error"]) + 1)
        ax.plot(steps, r["trajectory_rel_error"], style, label=f"{r['method']} ({r['psnr_db']} dB)")
    ax.set(
        xlabel="sampling step",
        ylabel="||x - x_serial|| / ||x_serial||",
        title="Stale K/V on the trained digits DiT: error after each step",
    )
    ax.legend(fontsize=7)
