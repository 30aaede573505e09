"""Latency tables that xDiT publishes with numbers (its other figures are images), as data,
for checking the planner against hardware we do not have.

Source: github.com/xdit-project/xDiT, docs/performance/{flux,sana,hunyuanvideo}.md at commit
175e0bfec974d0b44a0be9fa511df2f9f5ead080 (2026-07-14). Every row of each table is here;
nothing is left out. Each row: the parallel degrees and the published seconds for one
image (or video) end to end.
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


def _sp(u: int = 1, r: int = 1, pp: int = 1, cfg: bool = False) -> ParallelConfig:
    return ParallelConfig(ulysses_degree=u, ring_degree=r, pipefusion_degree=pp, cfg_parallel=cfg)


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
    PublishedTable(
        name="HunyuanVideo 1280x720x129, H100, 50 steps, Ulysses",
        model="hunyuanvideo-720p",
        device="h100",
        link="nvlink4",
        steps=50,
        guidance=False,
        rows=((_sp(), 1904.08), (_sp(u=2), 925.04), (_sp(u=4), 514.08), (_sp(u=8), 337.58)),
        source=f"{XDIT} docs/performance/hunyuanvideo.md, 1280x720 table, H100 row",
    ),
    PublishedTable(
        name="HunyuanVideo 1280x720x129, L20 (PCIe), 50 steps, Ulysses",
        model="hunyuanvideo-720p",
        device="l20",
        link="pcie4",
        steps=50,
        guidance=False,
        rows=((_sp(), 6043.88), (_sp(u=2), 3271.44), (_sp(u=4), 2080.05)),
        source=f"{XDIT} docs/performance/hunyuanvideo.md, 1280x720 table, L20 row (8 GPUs: not published)",
    ),
)
