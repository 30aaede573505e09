"""One register block of the ete73 constant stencil (4 planes x 2 rows jammed, the benchmark's
pick) in a C harness of its own: the block timed over x in [0, X) again and again (X 32: its rows
stay in L1; X 256: whole rows, from L2), 1 thread, best of 7. Two bodies: the generator's terms
(73 a row, each field value loaded once a block), and the x-pair sums shared (X_m = u(x+m) +
u(x-m), m = 1..3, read at dx = 0 from three arrays of their own: the x-star's and the planar
diagonals' pairs, 58 terms a row; the sums' own pass is not in its time). Prints cycles a vector
at the FMA peak's clock and the fraction of the 73-FMA bound (16 lanes, 2 FMAs a cycle).

    .venv/bin/python benchmarks/probes/stencil_block.py > benchmarks/results/intel-vm/stencil-block.txt
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from tessera.kernels.machine import cpu_description, peak_flops
from tessera.stencil import make_stencil

RZ, RY, N, H = 4, 2, 256, 6
PY = PX = N + 2 * H


def terms(shared: bool) -> list[tuple[int, int, int, int, float]]:
    """(array, dz, dy, dx, coefficient): array 0 the field, m the pair sums X_m."""
    out = []
    for p in make_stencil("ete73", "constant").points:
        (dz, dy, dx), c = p.offset, float(p.coeff)
        on_axes = sum(v != 0 for v in (dz, dy, dx))
        pair = shared and 0 < abs(dx) <= 3 and (on_axes == 1 or abs(dx) in (abs(dz), abs(dy)))
        if not pair:
            out.append((0, dz, dy, dx, c))
        elif dx > 0:  # the pair once, at dx = 0 of X_|dx|
            out.append((dx, dz, dy, 0, c))
    return out


def body(name: str, shared: bool, x_len: int) -> tuple[str, float]:
    rows = [(k, j) for k in range(RZ) for j in range(RY)]
    need: dict[tuple, list] = {}
    for r, (k, j) in enumerate(rows):
        for a, dz, dy, dx, c in terms(shared):
            need.setdefault((a, dz + k, dy + j, dx), []).append((r, c))
    lines = [f"static void {name}(float *restrict o, float *const *arr) {{",
             f"  const long base = (({H} + 16) * {PY} + ({H} + 16)) * {PX} + {H};",
             "  const float *q[4] = {arr[0] + base, arr[1] + base, arr[2] + base, arr[3] + base};",
             f"  for (long x = 0; x + 16 <= {x_len}; x += 16) {{",
             "    " + " ".join(f"vf a{r} = (vf){{}};" for r in range(len(rows)))]
    for i, ((a, dz, dy, dx), users) in enumerate(sorted(need.items(), key=lambda kv: kv[0][1:] + kv[0][:1])):
        pin = f' __asm__("" : "+v"(v{i}));' if len(users) > 1 else ""
        adds = " ".join(f"a{r} = a{r} + {c!r}f * v{i};" for r, c in users)
        lines.append(f"    {{ vf v{i} = LD(q[{a}] + x + {(dz * PY + dy) * PX + dx});{pin} {adds} }}")
    lines += [f"    ST(o + base + x + {(k * PY + j) * PX}, a{r});" for r, (k, j) in enumerate(rows)]
    lines.append("  }\n}")
    return "\n".join(lines), len(need) / len(rows)


def main() -> None:
    hz = peak_flops(1, seconds=0.3, isa="avx512") / 64  # 2 FMAs x 16 lanes x 2 flops a cycle
    print(f"# {cpu_description()}; ete73 constant, block rz {RZ} x ry {RY}, 1 thread; clock from the FMA peak "
          f"{hz / 1e9:.2f} GHz")
    src = ["#include <stdio.h>", "#include <stdlib.h>", "#include <time.h>",
           "typedef float vf __attribute__((vector_size(64)));",
           "typedef float vfu __attribute__((vector_size(64), aligned(4)));",
           "#define LD(p) (*(const vfu *)(p))", "#define ST(p, a) (*(vfu *)(p) = (a))",
           "static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); "
           "return t.tv_sec + 1e-9 * t.tv_nsec; }"]
    cases = []
    for x_len in (32, 256):
        for shared in (False, True):
            name = f"blk_{'pairs' if shared else 'terms'}_{x_len}"
            text, loads = body(name, shared, x_len)
            src.append(text)
            cases.append((name, x_len, shared, loads))
    src.append("int main(void) {")
    src.append(f"  long n = (long){PY} * {PY} * {PX}; float *arr[4], *o = aligned_alloc(64, n * 4 + 8192);")
    src.append("  for (int i = 0; i < 4; ++i) { arr[i] = aligned_alloc(64, n * 4 + 8192); "
               "for (long t = 0; t < n; ++t) arr[i][t] = (t % 13) * 0.1f; }")
    src.append("  for (long t = 0; t < n; ++t) o[t] = 0;")
    for name, x_len, shared, loads in cases:
        reps = 2_000_000 // (x_len * RZ * RY)
        src.append(f"  {{ double best = 1e9; for (int r = 0; r < 7; ++r) {{ double t = now(); "
                   f"for (long i = 0; i < {reps}; ++i) {name}(o, arr); t = now() - t; if (t < best) best = t; }}")
        src.append(f'    double vecs = (double){reps} * {x_len} / 16 * {RZ * RY}; printf("x %3d %-21s '
                   f'loads a vector {loads:4.1f}: %6.1f cycles a vector, %.3f of the 73-FMA bound\\n", {x_len}, '
                   f'"{"pair sums shared" if shared else "73 terms a row"}", best / vecs * {hz}, 73 * vecs / 2 / (best * {hz})); }}')
    src.append("  return (int)o[100];\n}")
    with tempfile.TemporaryDirectory() as d:
        c, exe = Path(d) / "block.c", Path(d) / "block"
        c.write_text("\n".join(src))
        subprocess.run(["gcc", "-O3", "-std=gnu11", "-mavx512f", "-mavx512vl", "-mfma", "-ffp-contract=fast", str(c),
                        "-o", str(exe)], check=True)
        for _ in range(3):  # three processes: the buffers' physical placement moves the figures
            sys.stdout.write(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)


if __name__ == "__main__":
    main()
