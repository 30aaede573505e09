"""Measure memory two ways, both usable on a CPU-only machine.

``TensorMemory`` (from ``tessera.memory.track``): the peak of live tensor memory, tracked
at the ATen dispatch level.

``rss_peak_during`` measures the process's resident-memory high-water mark (Linux
``VmHWM``, reset through ``/proc/self/clear_refs``) while a function runs, minus the
resident memory before: everything real, allocator and kernel scratch included. Run it in
a fresh process with ``MALLOC_MMAP_THRESHOLD_`` set low so freed blocks go back to the OS
(see ``fresh_process_env``); otherwise glibc keeps freed memory resident and later peaks
read low.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tessera.memory.track import TensorMemory, reset_peak_rss, status_kib

__all__ = ["TensorMemory", "fresh_process_env", "rss_peak_during"]


def rss_peak_during(fn: Callable[[], object]) -> tuple[int, object]:
    """(peak resident bytes above the resident bytes before, fn's result)."""
    before = reset_peak_rss()
    result = fn()
    return (status_kib("VmHWM") - before) * 1024, result


def fresh_process_env(threads: int = 1) -> dict[str, str]:
    """Environment for a measuring child: freed blocks above 64 KiB go back to the OS."""
    env = dict(os.environ)
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS=str(threads))
    return env
