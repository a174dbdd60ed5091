"""Builds of astrai's C extensions loaded side by side, so that a benchmark times them in
alternation in one process (quant_hot.py, decode_attention.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util


def load_build(path: str, module: str):
    """The extension module (e.g. "_quant_linear") from the build at path, beside any other
    build of it already loaded."""
    loader = importlib.machinery.ExtensionFileLoader(module, path)
    spec = importlib.util.spec_from_file_location(module, path, loader=loader)
    loaded = importlib.util.module_from_spec(spec)
    loader.exec_module(loaded)
    return loaded


def chosen_builds(paths: str | None, module: str, built) -> tuple[list[str], list]:
    """The names and modules of the builds in paths (comma-separated .so files), or of the
    built one (the module built, as astrai.kernels.native holds it) when paths is None."""
    if not paths:
        return ["built"], [built]
    names = paths.split(",")
    return names, [load_build(path, module) for path in names]
