"""`tessera stencil wave ...`: acoustic wave propagation on the stencil compiler, wavefield
snapshots as PNG. Parser and handler only; the work is in tessera.stencil.wave."""

from __future__ import annotations

import argparse


def _grid(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"grid {text!r} must be N or NZ,NY,NX (ints)") from None
    if len(dims) == 1:
        dims = dims * 3
    if len(dims) != 3 or min(dims) < 3:
        raise argparse.ArgumentTypeError(f"grid {text!r} must be N or NZ,NY,NX with every size >= 3")
    return dims


def add_stencil_parser(sub, positive_int) -> None:
    from tessera.stencil.names import SHAPES, VELOCITIES  # light: the parser loads no numpy

    p = sub.add_parser(
        "stencil", help="stencils on the operator compiler: wave (acoustic propagation, PNG snapshots)"
    )
    st = p.add_subparsers(dest="stencil_command", required=True)
    w = st.add_parser("wave", help="propagate a Ricker point source through a velocity model; PNG snapshots")
    w.add_argument("--shape", choices=SHAPES, default="ete37", help="the Laplacian stencil (default ete37)")
    w.add_argument("--grid", type=_grid, default=(96, 96, 96), help="cells: N or NZ,NY,NX (default 96)")
    w.add_argument("--spacing", type=float, default=10.0, help="metres per cell (default 10)")
    w.add_argument(
        "--velocity", choices=VELOCITIES, default="layered", help="velocity model (default layered)"
    )
    w.add_argument("--v-min", type=float, default=1500.0, help="slowest velocity, m/s")
    w.add_argument("--v-max", type=float, default=3000.0, help="fastest velocity, m/s")
    w.add_argument(
        "--frequency", type=float, help="Ricker peak frequency, Hz (default: 10 cells a wavelength at v-min)"
    )
    w.add_argument(
        "--cfl", type=float, default=0.4, help="CFL number v_max dt / h (refused past the stencil's limit)"
    )
    w.add_argument("--steps", type=positive_int, default=300, help="time steps")
    w.add_argument("--snapshots", type=int, default=4, help="PNG snapshots, evenly spaced (default 4)")
    w.add_argument(
        "--time-block", type=positive_int, default=1, help="time steps per z sweep (temporal blocking)"
    )
    w.add_argument("--threads", type=positive_int, default=1, help="OpenMP threads")
    w.add_argument("--out", default="runs/wave", help="folder for the PNGs (default runs/wave)")
    w.set_defaults(handler=cmd_stencil)


def cmd_stencil(args: argparse.Namespace) -> None:
    from tessera.stencil.wave import WaveConfig, cfl_limit, run_wave, write_snapshots

    if args.snapshots < 0:
        raise ValueError(f"--snapshots {args.snapshots} must be >= 0")
    cfg = WaveConfig(
        shape=args.shape,
        grid=args.grid,
        spacing=args.spacing,
        velocity=args.velocity,
        v_min=args.v_min,
        v_max=args.v_max,
        frequency=args.frequency,
        cfl=args.cfl,
        steps=args.steps,
        time_block=args.time_block,
        threads=args.threads,
    )
    result = run_wave(cfg, snapshots=min(args.snapshots, args.steps))
    paths = write_snapshots(result, args.out)
    points = cfg.grid[0] * cfg.grid[1] * cfg.grid[2] * cfg.steps
    print(
        f"wave: {cfg.shape} on {'x'.join(map(str, cfg.grid))} cells of {cfg.spacing:g} m, {cfg.velocity} medium "
        f"{cfg.v_min:g}-{cfg.v_max:g} m/s, Ricker {cfg.peak_frequency:.1f} Hz at cell {cfg.source_at}"
    )
    print(
        f"{cfg.steps} steps of dt = {cfg.dt * 1e3:.3f} ms (CFL {cfg.cfl:g}, stable up to {cfl_limit(cfg.shape):.4f}) "
        f"in {result.seconds:.2f} s on {cfg.threads} thread(s): {points / result.seconds / 1e9:.3f} GPts/s; "
        f"max |u| = {float(abs(result.field).max()):.3e}"
    )
    print(
        f"wrote {len(paths)} snapshot(s) to {args.out}"
        + (f": {', '.join(p.name for p in paths)}" if paths else "")
    )
