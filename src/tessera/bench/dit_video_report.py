"""The report of `tessera bench dit-video`: the video rows (each layout's time, speed-up and
bytes per step, measured against the formula), the emulated links' rows, the parallel VAE
rows, the columns and the plot."""

from __future__ import annotations

from pathlib import Path

from tessera.bench.harness import BenchResult
from tessera.diffusion.comm_bytes import Dims, formula_bytes, measured_bytes


def _video_rows(plan, serial, ranks, links, layouts: dict, dims: Dims):
    base = min(serial["all_seconds"])
    rows = [
        {
            "method": "serial",
            "ranks": 1,
            "seconds": round(base, 3),
            "all_seconds": serial["all_seconds"],
            "spread": _spread(serial["all_seconds"]),
            "speedup": 1.0,
            "bytes_per_step": 0,
            "formula_bytes_per_step": 0,
            "bytes_rel_error": 0.0,
            "rel_diff_vs_serial": 0.0,
        }
    ]
    link_rows = [
        {
            "method": "serial",
            "link": k,
            "seconds": round(v["seconds"], 3),
            "emulated_wait_s": 0.0,
            "speedup": 1.0,
        }
        for k, v in serial["links"].items()
    ]
    for name, config in layouts.items():
        per_run = [max(r["video"][name]["all_seconds"][i] for r in ranks) for i in range(plan.repeats)]
        measured = measured_bytes([r["video"][name]["ledger"] for r in ranks])
        formula = formula_bytes(config, dims)
        latent = ranks[0]["video"][name]["latent"]
        rows.append(
            {
                "method": name,
                "ranks": 2,
                "seconds": round(min(per_run), 3),
                "all_seconds": per_run,
                "spread": _spread(per_run),
                "speedup": round(base / min(per_run), 3),
                "bytes_per_step": measured // plan.steps,
                "formula_bytes_per_step": formula // plan.steps,
                "bytes_rel_error": abs(measured - formula) / formula,
                "rel_diff_vs_serial": float((latent - serial["latent"]).norm() / serial["latent"].norm()),
            }
        )
        for link in links:
            seconds = max(r["video"][name]["links"][link]["seconds"] for r in ranks)
            link_rows.append(
                {
                    "method": name,
                    "link": link,
                    "seconds": round(seconds, 3),
                    "emulated_wait_s": round(
                        max(r["video"][name]["links"][link]["emulated_s"] for r in ranks), 3
                    ),
                    "speedup": round(serial["links"][link]["seconds"] / seconds, 3),
                }
            )
    return rows, link_rows


def _spread(times) -> float:
    return round((max(times) - min(times)) / min(times), 3)


def _vae_rows(serial, chunked, ranks):
    rows = []
    for kind in ("AutoencoderKL", "AutoencoderKLWan"):
        s = serial[kind]
        rows.append(
            {
                "vae": kind,
                "decode": "serial",
                "seconds": round(s["seconds"], 3),
                "speedup": 1.0,
                "peak_mib": round(s["peak"] / 2**20, 2),
                "peak_vs_serial": 1.0,
            }
        )
        cases = [("2 ranks", [r["vae"][(kind, None)] for r in ranks])]
        if kind == "AutoencoderKL":
            cases += [
                ("2 ranks, chunks of 8 rows", [r["vae"][(kind, 8)] for r in ranks]),
                ("1 device, chunks of 8 rows", [chunked[(kind, 8)]]),
            ]
        for label, parts in cases:
            seconds, peak = max(p["seconds"] for p in parts), max(p["peak"] for p in parts)
            rows.append(
                {
                    "vae": kind,
                    "decode": label,
                    "seconds": round(seconds, 3),
                    "speedup": round(s["seconds"] / seconds, 3),
                    "peak_mib": round(peak / 2**20, 2),
                    "peak_vs_serial": round(peak / s["peak"], 3),
                }
            )
    return rows


VIDEO_COLUMNS = [
    "method",
    "ranks",
    "seconds",
    "spread",
    "speedup",
    "bytes_per_step",
    "formula_bytes_per_step",
    "bytes_rel_error",
    "rel_diff_vs_serial",
]
LINK_COLUMNS = ["method", "link", "seconds", "emulated_wait_s", "speedup"]
VAE_COLUMNS = ["vae", "decode", "seconds", "speedup", "peak_mib", "peak_vs_serial"]


def plot_dit_video(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    methods = [r["method"] for r in result.rows if r["method"] != "serial"]
    left.bar(methods, [r["speedup"] for r in result.rows if r["method"] != "serial"], label="loopback")
    for link in {r["link"] for r in result.extra["link_rows"]}:
        left.plot(
            methods,
            [
                r["speedup"]
                for r in result.extra["link_rows"]
                if r["link"] == link and r["method"] != "serial"
            ],
            "o-",
            color="C1",
            label=link,
        )
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel("speedup vs serial (2 ranks)")
    left.set_title("video DiT (Wan-shaped)")
    left.legend()
    vae = result.extra["vae_rows"]
    labels = [f"{r['vae'].replace('Autoencoder', '')}\n{r['decode']}" for r in vae]
    right.bar(range(len(vae)), [r["peak_vs_serial"] for r in vae], color="C2")
    right.set_xticks(range(len(vae)), labels, fontsize=6)
    right.axhline(0.6, color="grey", ls="--", lw=0.8)
    right.set_ylabel("activation peak per rank / serial")
    right.set_title("VAE decode")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
