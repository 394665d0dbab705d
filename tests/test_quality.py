"""The package type-checks under mypy --strict and passes the linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_strict() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "sa_jobqueue"], cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff() -> None:
    out = subprocess.run(
        # The examples and benchmarks are code users read and run: they are held to the same rules.
        [sys.executable, "-m", "ruff", "check", "sa_jobqueue", "tests", "examples", "benchmarks"], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
