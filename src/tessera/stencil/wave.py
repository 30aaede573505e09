"""Acoustic wave propagation on the stencil compiler: u_tt = v(x)^2 lap u + s(t) delta(x - x_s),
second order in time (leapfrog), a shipped stencil for the Laplacian, zero (Dirichlet)
boundaries in the halo.

    u(n+1) = 2 u(n) - u(n-1) + sum_p (v dt / h)^2 w_p u(n)(x + p)  +  dt^2 s(t_n) / h^3 at x_s

A constant velocity gives scalar coefficients; a layered or smooth one gives one coefficient
array per symmetry class of offsets, k(x) = (v(x) dt / h)^2 w_class (spatially variant).
The source is a Ricker wavelet of peak frequency f, delayed by 1.5 / f.

Stability: the leapfrog scheme is stable iff C^2 lambda_max <= 4, where C = v_max dt / h is
the CFL number and lambda_max the largest value of minus the stencil's symbol; so
C <= 2 / sqrt(lambda_max) (1 / sqrt(3) for star7). A larger C is refused unless the caller
asks for the unstable run (the tests do).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessera.stencil.kernel import compile_wave
from tessera.stencil.names import VELOCITIES
from tessera.stencil.schedule import StencilSchedule
from tessera.stencil.shapes import SHAPES, shape_weights, symbol_max
from tessera.stencil.stencil import Stencil, make_stencil, padded_shape, weight_arrays


def cfl_limit(shape: str) -> float:
    """The largest stable CFL number v_max dt / h of the leapfrog scheme with this stencil."""
    return 2.0 / math.sqrt(symbol_max(shape_weights(shape)))


def ricker(t: np.ndarray, frequency: float, delay: float) -> np.ndarray:
    a = (math.pi * frequency * (t - delay)) ** 2
    return (1.0 - 2.0 * a) * np.exp(-a)


@dataclass(frozen=True, kw_only=True)
class WaveConfig:
    shape: str = "ete37"
    grid: tuple[int, int, int] = (96, 96, 96)  # interior cells (nz, ny, nx); z is depth
    spacing: float = 10.0  # metres per cell
    velocity: str = "layered"
    v_min: float = 1500.0  # m/s
    v_max: float = 3000.0
    frequency: float | None = None  # Hz; default: 10 cells per wavelength at v_min
    cfl: float = 0.4  # v_max dt / h
    steps: int = 300
    source: tuple[int, int, int] | None = None  # default: centre in x and y, a quarter down in z
    time_block: int = 1
    threads: int = 1
    allow_unstable: bool = False
    schedule: StencilSchedule = field(default_factory=StencilSchedule)

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"stencil shape {self.shape!r}; choose one of {', '.join(SHAPES)}")
        if len(self.grid) != 3 or any(not isinstance(n, int) or n < 3 for n in self.grid):
            raise ValueError(f"grid {self.grid!r} must be three ints >= 3")
        width = 2 * make_stencil(self.shape).radius + 1
        if min(self.grid) < width:
            raise ValueError(f"grid {self.grid!r} is narrower than {self.shape}'s width of {width} cells (radius "
                             f"{width // 2} on each side of a cell); use at least {width} cells on every axis")
        if self.velocity not in VELOCITIES:
            raise ValueError(f"velocity model {self.velocity!r}; choose one of {', '.join(VELOCITIES)}")
        if not 0 < self.v_min <= self.v_max:
            raise ValueError(f"velocities v_min={self.v_min}, v_max={self.v_max} must satisfy 0 < v_min <= v_max")
        for name in ("spacing", "cfl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("steps", "time_block", "threads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")
        limit = cfl_limit(self.shape)
        if self.cfl > limit and not self.allow_unstable:
            raise ValueError(f"CFL number {self.cfl} exceeds the leapfrog stability limit {limit:.4f} of {self.shape} "
                             f"(2 / sqrt(max symbol)); use cfl <= {limit:.4f}")
        if self.source is not None and not all(0 <= s < n for s, n in zip(self.source, self.grid, strict=True)):
            raise ValueError(f"source {self.source} lies outside the grid {self.grid}")

    @property
    def dt(self) -> float:
        return self.cfl * self.spacing / self.v_max

    @property
    def peak_frequency(self) -> float:
        return self.frequency or self.v_min / (10 * self.spacing)

    @property
    def source_at(self) -> tuple[int, int, int]:
        nz, ny, nx = self.grid
        return self.source or (nz // 4, ny // 2, nx // 2)


def velocity_model(config: WaveConfig) -> np.ndarray:
    """v(z, y, x): constant v_max; three flat layers from v_min down to v_max; or a smooth
    increase with depth plus a Gaussian low-velocity lens below the source."""
    nz, ny, nx = config.grid
    lo, hi = config.v_min, config.v_max
    z = (np.arange(nz) / max(1, nz - 1))[:, None, None]
    if config.velocity == "constant":
        v = np.full((nz, 1, 1), hi)
    elif config.velocity == "layered":
        v = np.where(z < 0.4, lo, np.where(z < 0.7, (lo + hi) / 2, hi))
    else:
        y = (np.arange(ny) / max(1, ny - 1))[None, :, None]
        x = (np.arange(nx) / max(1, nx - 1))[None, None, :]
        lens = np.exp(-((z - 0.6) ** 2 + (y - 0.5) ** 2 + (x - 0.5) ** 2) / 0.02)
        v = lo + (hi - lo) * z - 0.3 * (hi - lo) * lens
        v = np.clip(v, lo, hi)
    return np.ascontiguousarray(np.broadcast_to(v, config.grid), dtype=np.float64)


def wave_stencil(config: WaveConfig) -> tuple[Stencil, dict[str, np.ndarray]]:
    """The update's stencil: scalars (C^2 w_p) for a constant medium, else per-class arrays."""
    courant2 = (velocity_model(config) * config.dt / config.spacing) ** 2
    if config.velocity == "constant":
        c2 = float(courant2.flat[0])
        base = make_stencil(config.shape, "constant")
        weights = shape_weights(config.shape)
        points = tuple(type(p)(p.offset, float(np.float32(c2 * float(weights[p.offset])))) for p in base.points)
        return Stencil(name=f"wave-{config.shape}", points=points, halo=base.halo), {}
    st = make_stencil(config.shape, "class")
    return st, weight_arrays(st, config.shape, config.grid, scale=courant2)


@dataclass
class WaveResult:
    config: WaveConfig
    field: np.ndarray  # u at the last step, with halo
    snapshots: list[tuple[int, np.ndarray]]  # (step, the y = source slice of the interior)
    traces: np.ndarray  # (steps, receivers) u at each receiver after each step
    seconds: float


def source_wavelet(config: WaveConfig) -> np.ndarray:
    """dt^2 s(t_n) / h^3 for n = 0..steps-1 (the amount added at the source cell per step)."""
    f = config.peak_frequency
    t = np.arange(config.steps) * config.dt
    return (config.dt ** 2 * ricker(t, f, 1.5 / f) / config.spacing ** 3).astype(np.float32)


def run_wave(config: WaveConfig, *, snapshots: int = 0, receivers: tuple[tuple[int, int, int], ...] = ()) -> WaveResult:
    """Propagate; ``snapshots`` evenly spaced slices kept; with ``receivers`` one step per call."""
    import time

    st, coeffs = wave_stencil(config)
    kernel = compile_wave(st, config.grid, dataclasses.replace(config.schedule, time_block=config.time_block))
    prev = np.zeros(padded_shape(config.grid, st.halo), np.float32)
    cur = np.zeros_like(prev)
    src, at, h = source_wavelet(config), config.source_at, st.halo
    snap_steps = {config.steps * (i + 1) // snapshots for i in range(snapshots)}
    stops = list(range(1, config.steps + 1)) if receivers else sorted(snap_steps | {config.steps})
    shots, traces, done = [], [], 0
    began = time.perf_counter()
    for stop in stops:
        prev, cur = kernel.run(prev, cur, coeffs, src[done:stop], at, threads=config.threads)
        done = stop  # the kernel counts steps from 0 in each call: it gets its slice of the wavelet
        if receivers:
            traces.append([cur[z + h, y + h, x + h] for z, y, x in receivers])
        if stop in snap_steps:
            shots.append((stop, cur[h:-h, at[1] + h, h:-h].copy()))
    return WaveResult(config, cur, shots, np.array(traces, dtype=np.float64), time.perf_counter() - began)


def write_snapshots(result: WaveResult, out_dir: str | Path) -> list[Path]:
    """One PNG per snapshot: the wavefield in the vertical (z, x) plane through the source,
    velocity contours over it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = result.config
    v = velocity_model(cfg)[:, cfg.source_at[1], :]
    paths = []
    for step, plane in result.snapshots:
        scale = float(np.abs(plane).max()) or 1.0
        fig, ax = plt.subplots(figsize=(5, 5 * plane.shape[0] / plane.shape[1] + 0.6))
        extent = (0, plane.shape[1] * cfg.spacing, plane.shape[0] * cfg.spacing, 0)
        ax.imshow(plane, cmap="seismic", vmin=-scale, vmax=scale, extent=extent)
        if cfg.velocity != "constant":
            ax.contour(v, levels=4, colors="k", linewidths=0.5, extent=(0, extent[1], 0, extent[2]), origin="upper")
        ax.set_title(f"{cfg.shape}, {cfg.velocity} medium, t = {step * cfg.dt * 1e3:.0f} ms (step {step})")
        ax.set_xlabel("x (m)")
        ax.set_ylabel("depth (m)")
        path = out_dir / f"wave_{step:05d}.png"
        fig.savefig(path, dpi=80, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
