"""ruff and mypy stay clean (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint_and_format() -> None:
    lint = _run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy() -> None:
    result = _run(
        "mypy", "protos", "security", "control_plane", "worker", "dedup_service", "clients", "tests", "bench", "scripts"
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_layers_and_no_import_cycles() -> None:
    """import-linter's contracts in pyproject.toml (docs/architecture.md, "Layers")."""
    result = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
