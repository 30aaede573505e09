"""Every script in examples/ runs at its tiny default size, as a user runs it: a fresh
interpreter on the script's path (`python examples/NAME.py`), one thread per process, no
network. Each script checks its own result (PipeFusion against its stale-K/V reference,
offload bit-exact with training in memory, the GEMM within the float32 bound, the wave's
arrival time, ...) and exits non-zero when the check fails; here each must exit 0 and print
its last line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# script -> a piece of what it prints when it worked
RUNS = {
    "generate_pipefusion.py": "distance from its stale-K/V reference",
    "serve_query.py": "server stopped: drained, engine ended",
    "offload_train.py": "bit-exact: the same losses with and without offload",
    "autochunk_evoformer.py": "largest difference from the original block",
    "kernels_gemm.py": "of the float32 bound",
    "stencil_wave.py": "arrival at 8 cells",
    "plan_search.py": "GiB/rank",
}
# scripts another test runs the way they are meant to be run
RUN_ELSEWHERE = {"launch_train.py": "tests/runtime/test_launch_cli.py"}  # under `tessera launch -n 2`


def test_every_example_is_run():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(RUNS) | set(RUN_ELSEWHERE), scripts ^ (set(RUNS) | set(RUN_ELSEWHERE))
    for script, test in RUN_ELSEWHERE.items():
        assert script in (ROOT / test).read_text(), f"{test} does not run examples/{script}"


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script, kernel_cache, tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TESSERA_KERNEL_CACHE": str(kernel_cache),  # conftest: one temporary cache for the session
    }
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang fails the test; the scripts take seconds
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert RUNS[script] in result.stdout, output[-4000:]
