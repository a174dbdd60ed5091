"""The built wheel carries the demo model and generates with it after a clean install."""

from __future__ import annotations

import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            out,
            ROOT,
        ],
        check=True,
        capture_output=True,
    )
    [path] = out.glob("astrai-*.whl")
    return path


def test_wheel_contains_the_demo_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in DEMO_FILES:
        assert f"astrai/assets/demo/{name}" in names


def test_wheel_generates_in_a_fresh_virtual_environment(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = venv / "bin" / "python"
    # This interpreter's site-packages supply torch and the other dependencies (whether it is
    # the system Python or a virtual environment itself); astrai comes from the wheel. A .pth
    # file's directories are searched after the venv's own, and their .pth files (an editable
    # install of astrai) are not run.
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "parent_site_packages.pth").write_text("\n".join(site.getsitepackages()))
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "-q", wheel],
        check=True,
        capture_output=True,
    )
    where = subprocess.run(
        [python, "-c", "import astrai; print(astrai.__file__)"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert str(venv) in where
    result = subprocess.run(
        [venv / "bin" / "astrai", "generate", "--max-tokens", "8", "--temperature", "0", "The"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
