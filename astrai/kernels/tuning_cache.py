"""Kernel choices timed at start-up, kept on disk so that only a machine's first start pays.

Timing the linears' paths takes a second or more per model and dtype; its answer depends on
the machine, the thread count and the code, so those make up the key, with the weights'
shapes. The file lives in $ASTRAI_CACHE_DIR, else $XDG_CACHE_HOME/astrai, else
~/.cache/astrai. A cache that cannot be read or written is ignored: the paths are timed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import astrai
from astrai.kernels import native

log = logging.getLogger(__name__)
CACHE_FILE = "tuned_paths.json"


def cache_dir() -> Path:
    if os.environ.get("ASTRAI_CACHE_DIR"):
        return Path(os.environ["ASTRAI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "astrai"


def tuning_key(kind: str, dtype: torch.dtype, shapes: object) -> str:
    """What a timing's answer depends on: the CPU, the threads, torch, astrai's own build, and
    the op, dtype and weight shapes timed."""
    modules = sorted(
        f"{name}:{os.stat(module.__file__).st_mtime_ns}"
        for name in ("skinny_linear", "quant_linear")
        if (module := getattr(native, name, None)) is not None
    )
    parts = (
        _cpu(), torch.get_num_threads(), torch.__version__, astrai.__version__, modules,
        kind, str(dtype), shapes,
    )  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def remembered(
    kind: str, dtype: torch.dtype, shapes: object, measure: Callable[[], list[str]]
) -> list[str]:
    """measure()'s answer for this kind, dtype and shapes on this machine: read from the file,
    or measured now and stored."""
    key = tuning_key(kind, dtype, shapes)
    found = lookup(key)
    if found is None:
        found = [str(item) for item in measure()]
        store(key, found)
    return found


def lookup(key: str) -> list[str] | None:
    return _read().get(key)


def store(key: str, paths: list[str]) -> None:
    """Add key's paths to the file, written whole to a temporary file and renamed, so that
    processes starting at once never read half a file."""
    entries = {**_read(), key: paths}
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as file:
            json.dump(entries, file)
        os.replace(file.name, directory / CACHE_FILE)
    except OSError as error:
        log.debug("cannot write the tuning cache in %s: %s", directory, error)


def _read() -> dict[str, list[str]]:
    try:
        entries = json.loads((cache_dir() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _cpu() -> str:
    """The CPU's model name and feature flags (one VM type's name can hide several CPUs)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()
