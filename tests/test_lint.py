"""The package, the tests and the benchmarks pass ruff with the repository's ruff.toml."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ruff() -> list:
    # Beside this interpreter (a venv's bin/), else on PATH; ruff is in the dev extra.
    exe = pathlib.Path(sys.executable).with_name("ruff")
    found = str(exe) if exe.exists() else shutil.which("ruff")
    assert found, "ruff is not installed: pip install -e '.[dev]' installs it"
    return [found]


def test_ruff_is_clean():
    cmd = _ruff() + ["check", "--no-cache", "--config", str(ROOT / "ruff.toml"), "kerasfeed", "tests", "benchmarks"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff found problems:\n{proc.stdout}{proc.stderr}"

