"""A hard memory limit for a benchmark's child process, where the machine allows one: a
control group of its own with the limit set (cgroup v2 ``memory.max`` with
``memory.swap.max`` 0, or cgroup v1 ``memory.limit_in_bytes``), the child moved into it
before it runs. A child that passes the limit is killed by the kernel (SIGKILL): the limit
is the budget, set-up included, not a check after the fact.

The group counts what the kernel charges to the process: its resident pages and the page
cache of the files it writes (the disk tier's), which the kernel reclaims under the limit
(written back first), so a job that stays within the limit by reclaiming cache lives.

Where no group can be made (no root, a read-only cgroup file system, macOS), ``HardLimit``
says why and the caller falls back to its own check (the resident high-water mark).
"""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

_ROOTS = (("v2", Path("/sys/fs/cgroup")), ("v1", Path("/sys/fs/cgroup/memory")))
_count = itertools.count()


def _kind(root: Path) -> str | None:
    if (root / "cgroup.controllers").exists():
        return "v2" if "memory" in (root / "cgroup.controllers").read_text().split() else None
    return "v1" if (root / "memory.limit_in_bytes").exists() else None


class HardLimit:
    """``HardLimit(nbytes)``: ``.applied`` (bool), ``.how`` (what was set, or why not);
    ``preexec`` for ``subprocess.run(preexec_fn=...)``; ``peak_bytes()`` and ``killed()`` after
    the child ended; ``close()`` removes the group (also on ``with`` exit)."""

    def __init__(self, nbytes: int):
        self.nbytes, self.path, self.version = int(nbytes), None, None
        if self.nbytes < 1:
            raise ValueError(f"a memory limit must be a positive number of bytes, got {nbytes!r}")
        reasons = []
        for version, root in _ROOTS:
            if _kind(root) != version:
                continue
            path = root / f"tessera-limit-{os.getpid()}-{next(_count)}"
            try:
                path.mkdir()
                if version == "v2":
                    (path / "memory.max").write_text(str(self.nbytes))
                    if (path / "memory.swap.max").exists():
                        (path / "memory.swap.max").write_text("0")
                else:
                    (path / "memory.limit_in_bytes").write_text(str(self.nbytes))
                    swap = path / "memory.memsw.limit_in_bytes"
                    if swap.exists():
                        swap.write_text(str(self.nbytes))
            except OSError as exc:
                reasons.append(f"cgroup {version} at {root}: {exc.strerror or exc}")
                _remove(path)
                continue
            self.path, self.version = path, version
            break
        else:
            if not reasons:
                reasons.append("no cgroup memory controller found")
        self.applied = self.path is not None
        if self.applied:
            knob = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
            self.how = f"cgroup {self.version} {knob} = {self.nbytes / 2**20:.0f} MiB"
        else:
            self.how = "not applied (" + "; ".join(reasons) + ")"

    def preexec(self) -> None:
        """In the child, before it runs: join the group (a no-op when none was made)."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        """The group's charged high-water mark (v2 ``memory.peak``, v1 ``memory.max_usage_in_bytes``)."""
        if self.path is None:
            return None
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def killed(self, returncode: int | None) -> bool:
        """Whether a child that ended with ``returncode`` was killed for passing the limit."""
        if self.path is None or returncode != -signal.SIGKILL:
            return False
        if self.version == "v2":
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0)) > 0 or int(events.get("max", 0)) > 0
        control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return int(control.get("oom_kill", 0)) > 0 or int((self.path / "memory.failcnt").read_text()) > 0

    def close(self) -> None:
        if self.path is not None:
            _remove(self.path)
            self.path = None

    def __enter__(self) -> HardLimit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
