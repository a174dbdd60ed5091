"""How astrai's compute threads wait and how many there are, set before torch starts OpenMP.

torch's OpenMP runtime (libgomp, which astrai's kernels share) reads its settings once, when
torch is loaded, so importing astrai sets them first, unless the user already has or torch is
already loaded:
- GOMP_SPINCOUNT=3000: a thread out of work spins that many times, then sleeps. libgomp's
  default, 300,000 (~3 ms), keeps idle threads on the cores that the working ones need when
  another process is busy beside astrai: batch-1 decode fell 10-20x. Sleeping at once
  (OMP_WAIT_POLICY=passive) pays a wake-up at every parallel op, which halved decode on an
  idle machine; 3000 spins bridge the gaps between a step's kernels and still give the cores
  up long before a time slice ends (benchmarks/README.md, benchmarks/contention.py). A wait
  policy or spin count the user set wins.
- OMP_NUM_THREADS from the cgroup CPU quota (a container run with --cpus) where it grants
  fewer CPUs than the process may run on: OpenMP counts the CPUs, not the time granted.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
SPIN_COUNT = 3000


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """The CPUs the cgroup's quota grants (cgroup v2 cpu.max, else v1), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 else None


def affinity_cpus() -> int:
    """The CPUs this process may run on, by which OpenMP and torch size their thread pools."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def available_cpus(root: Path = CGROUP) -> int:
    """The CPUs this process can use: those it may run on, capped by the cgroup's quota."""
    limit = cgroup_cpu_limit(root)
    cpus = affinity_cpus()
    return cpus if limit is None else max(1, min(cpus, math.ceil(limit)))


def configure_openmp() -> None:
    """Default GOMP_SPINCOUNT and OMP_NUM_THREADS as the module docstring says."""
    if "torch" in sys.modules:  # its OpenMP runtime has read the environment already
        return
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    cpus = available_cpus()
    if cpus < affinity_cpus():
        os.environ.setdefault("OMP_NUM_THREADS", str(cpus))
