"""Latency tables that xDiT publishes with numbers (its other figures are images), as data,
for checking the planner against hardware we do not have.

Source: github.com/xdit-project/xDiT, docs/performance/{flux,sana,hunyuanvideo}.md at commit
175e0bfec974d0b44a0be9fa511df2f9f5ead080 (2026-07-14). Every numeric table there is here,
every row and column: FLUX's PyTorch and torch.compile columns, SANA, HunyuanVideo's
1280x720 and 960x960 tables for H100, H20 and L20 (the empty cells are not published).
Each row: the parallel degrees and the published seconds for one image (or video) end to
end. ``compiled`` tables ran under torch.compile, whose fused kernels the eager op count of
tessera.plan.host_ops does not describe: no host floor is applied to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.diffusion.layout import ParallelConfig

XDIT = "xdit-project/xDiT@175e0bf"


@dataclass(frozen=True, kw_only=True)
class PublishedTable:
    name: str
    model: str  # a tessera.plan.model_spec preset
    device: str  # a tessera.plan.devices profile
    link: str  # a tessera.runtime.link profile between the devices
    steps: int
    guidance: bool  # classifier-free guidance doubles the model batch (or splits over cfg)
    rows: tuple[tuple[ParallelConfig, float], ...]
    source: str
    note: str = ""
    compiled: bool = False  # torch.compile: no eager host floor


def _sp(u: int = 1, r: int = 1, pp: int = 1, cfg: bool = False) -> ParallelConfig:
    return ParallelConfig(ulysses=u, ring=r, pipefusion=pp, cfg_parallel=cfg)


TABLES: tuple[PublishedTable, ...] = (
    PublishedTable(
        name="flux-dev 1024px, 4xH100 (NVLink), 28 steps, PyTorch",
        model="flux-dev",
        device="h100",
        link="nvlink4",
        steps=28,
        guidance=False,
        rows=(
            (_sp(), 6.71),
            (_sp(u=2), 4.38),
            (_sp(r=2), 5.31),
            (_sp(u=2, r=2), 5.19),
            (_sp(u=4), 4.24),
            (_sp(r=4), 5.11),
        ),
        source=f"{XDIT} docs/performance/flux.md, table 'PyTorch (Sec)' column",
        note="end to end: text encoders and VAE decode are in the published seconds, not parallelised",
    ),
    PublishedTable(
        name="flux-dev 1024px, 4xH100 (NVLink), 28 steps, torch.compile",
        model="flux-dev",
        device="h100",
        link="nvlink4",
        steps=28,
        guidance=False,
        rows=(
            (_sp(), 4.30),
            (_sp(u=2), 2.68),
            (_sp(r=2), 2.60),
            (_sp(u=2, r=2), 1.80),
            (_sp(u=4), 1.63),
            (_sp(r=4), 1.98),
        ),
        source=f"{XDIT} docs/performance/flux.md, table 'torch.compile (Sec)' column",
        compiled=True,
    ),
    PublishedTable(
        name="SANA 1600M 4096px, 8xA100 (NVLink), 20 steps",
        model="sana-1600m-4k",
        device="a100",
        link="nvlink3",
        steps=20,
        guidance=True,
        rows=(
            (_sp(), 17.551),
            (_sp(pp=2), 11.276),
            (_sp(r=2), 11.447),
            (_sp(u=2), 10.175),
            (_sp(cfg=True), 8.365),
            (_sp(pp=2, cfg=True), 5.599),
            (_sp(r=2, cfg=True), 5.702),
            (_sp(u=2, cfg=True), 5.803),
            (_sp(pp=4, cfg=True), 4.050),
            (_sp(r=2, pp=2, cfg=True), 4.091),
            (_sp(r=4, cfg=True), 4.003),
            (_sp(u=2, pp=2, cfg=True), 4.201),
            (_sp(u=2, r=2, cfg=True), 3.991),
        ),
        source=f"{XDIT} docs/performance/sana.md",
    ),
    *(
        PublishedTable(
            name=f"HunyuanVideo {size}x129, {gpu.upper()}{' (PCIe)' if link == 'pcie4' else ''}, 50 steps, Ulysses",
            model="hunyuanvideo-720p",  # 960x960 has the same 118,800 latent tokens as 1280x720
            device=gpu,
            link=link,
            steps=50,
            guidance=False,
            rows=tuple((_sp(u=u), seconds) for u, seconds in rows),
            source=f"{XDIT} docs/performance/hunyuanvideo.md, {size} table, {gpu.upper()} row"
            + (" (its largest GPU count: not published)" if gpu == "l20" else ""),
        )
        for size, gpu, link, rows in (
            ("1280x720", "h100", "nvlink4", ((1, 1904.08), (2, 925.04), (4, 514.08), (8, 337.58))),
            ("1280x720", "h20", "nvlink4", ((1, 6639.17), (2, 3400.55), (4, 1762.86), (8, 940.97))),
            ("1280x720", "l20", "pcie4", ((1, 6043.88), (2, 3271.44), (4, 2080.05))),
            ("960x960", "h100", "nvlink4", ((1, 1735.01), (2, 934.09), (3, 645.45), (6, 367.02))),
            ("960x960", "h20", "nvlink4", ((1, 6621.46), (2, 3400.55), (3, 2310.48), (6, 1214.67))),
            ("960x960", "l20", "pcie4", ((1, 6039.08), (2, 3260.62), (3, 2284.74))),
        )
    ),
)
