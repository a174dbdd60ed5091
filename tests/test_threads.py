"""Importing astrai sets how OpenMP threads wait and how many there are, before torch starts."""

from __future__ import annotations

import os
import subprocess
import sys

from astrai.threads import SPIN_COUNT, affinity_cpus, available_cpus, cgroup_cpu_limit


def openmp_settings(code: str, **env: str) -> str:
    """What libgomp reports it runs with (OMP_DISPLAY_ENV) in a fresh process running code."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    clean.update(env, OMP_DISPLAY_ENV="verbose")
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True
    )
    return done.stderr


def test_importing_astrai_first_limits_how_long_idle_threads_spin():
    assert f"GOMP_SPINCOUNT = '{SPIN_COUNT}'" in openmp_settings("import astrai, torch")
    # imported after torch, astrai can change nothing, and leaves the environment alone
    shipped = openmp_settings("import torch, astrai, os; assert 'GOMP_SPINCOUNT' not in os.environ")
    assert "GOMP_SPINCOUNT = '300000'" in shipped


def test_a_users_wait_policy_or_spin_count_is_kept():
    assert "GOMP_SPINCOUNT = '0'" in openmp_settings(
        "import astrai, torch", OMP_WAIT_POLICY="passive"
    )
    assert "GOMP_SPINCOUNT = '7'" in openmp_settings("import astrai, torch", GOMP_SPINCOUNT="7")


def test_the_cgroup_quota_caps_the_threads(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(v2) == 1.5
    assert available_cpus(v2) == min(affinity_cpus(), 2)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2) is None
    assert available_cpus(v2) == affinity_cpus()

    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1.parent) == 0.5
    assert available_cpus(v1.parent) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1.parent) is None
    assert cgroup_cpu_limit(tmp_path / "none") is None
