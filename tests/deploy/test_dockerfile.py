"""The Dockerfile, read instead of built (no Docker engine runs here): its command is a real `coalesce`
command, what it copies exists and is not ignored, .dockerignore keeps the venv, node_modules, tests and caches
out, and the copied files alone install as the `coalesce` package with its console script."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from clients.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copied_sources() -> list[str]:
    sources = []
    for word, rest in instructions():
        if word == "COPY" and not rest.startswith("--from"):
            sources += rest.split()[:-1]
    return sources


def ignored() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_cmd_is_a_real_coalesce_command() -> None:
    (cmd,) = [json.loads(rest) for word, rest in instructions() if word == "CMD"]
    assert cmd[0] == "coalesce"
    args = build_parser().parse_args(cmd[1:])
    assert args.command == "serve"
    assert args.host == "0.0.0.0"


def test_runs_as_a_numeric_non_root_user() -> None:
    (user,) = [rest for word, rest in instructions() if word == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0  # numeric, so runAsNonRoot can verify it
    # The chart's pods run as the same uid.
    assert "runAsUser: " + uid in (ROOT / "helm" / "coalesce" / "values.yaml").read_text()


def test_torch_is_the_build_the_install_script_pins() -> None:
    pin = re.search(r'"torch==([0-9.]+)"', (ROOT / "scripts" / "install.sh").read_text())
    assert pin is not None
    assert f"ARG TORCH_VERSION={pin.group(1)}" in DOCKERFILE.read_text()


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = ignored()
    for must in (".venv", "node_modules", "tests", ".git", "**/__pycache__", ".pytest_cache", ".mypy_cache",
                 ".ruff_cache", ".hypothesis", "*.egg-info"):  # fmt: skip
        assert must in patterns, f".dockerignore must exclude {must}"
    for source in copied_sources():
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
        assert source not in patterns, f"Dockerfile copies {source}, which .dockerignore excludes"


def test_the_copied_files_alone_install_the_package(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for source in copied_sources():
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, context / source)
    wheels = tmp_path / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    proc = subprocess.run([*cmd, str(context)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = wheels.glob("coalesce-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("clients/cli.py", "control_plane/embedded.py", "worker/server.py", "dedup_service/server.py",
                   "protos/coalesce/v1/inference_pb2.py", "protos/coalesce/v1/inference.proto"):  # fmt: skip
        assert module in names, f"the image would lack {module}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "coalesce = clients.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
