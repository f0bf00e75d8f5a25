"""The `coalesce` command line and the settings' precedence (flags > env > YAML > defaults)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clients.cli import _worker_overrides, build_parser
from control_plane.config import load_settings

COMMANDS = ["serve", "control-plane", "worker", "dedup-service", "generate", "chat", "batch", "bench"]


def _coalesce(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], capture_output=True, text=True, timeout=60)


def test_top_level_help_lists_every_command() -> None:
    result = _coalesce("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert command in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command: str) -> None:
    result = _coalesce(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: coalesce " + command)


@pytest.mark.parametrize("name", ["worker_step", "perplexity", "kv_cache"])
def test_bench_runs_benches_that_import_each_other(name: str, tmp_path: Path) -> None:
    """From any directory: the benches import `bench.*`, which needs the repository root on the path."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "clients" / "cli.py"), "bench", name, "--help"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:")


def test_bad_input_is_one_line_not_a_traceback() -> None:
    result = _coalesce("control-plane")
    assert result.returncode == 2
    needs = "coalesce control-plane needs workers: --worker HOST:PORT, or worker_dns (NAME:PORT)"
    assert result.stderr.strip() == f"coalesce control-plane: {needs}"
    result = _coalesce("serve", "--config", "/nonexistent.yaml")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "config file not found: /nonexistent.yaml" in result.stderr


def test_parser_maps_generate_flags() -> None:
    args = build_parser().parse_args(["generate", "hi", "--max-tokens", "5", "--seed", "3", "--pool", "batch"])
    assert (args.prompt, args.max_tokens, args.seed, args.pool) == ("hi", 5, 3, "batch")


def test_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "coalesce.yaml"
    config.write_text(
        "port: 7000\nmetrics_port: 9000\npools:\n  batch: {max_batch: 32, max_wait_ms: 100, kv_share: 0.5}\n"
    )
    monkeypatch.delenv("COALESCE_CONFIG", raising=False)
    monkeypatch.setenv("COALESCE_METRICS_PORT", "9100")
    monkeypatch.setenv("COALESCE_POOLS__INTERACTIVE__MAX_BATCH", "4")
    settings = load_settings(str(config), port=7100)
    assert settings.port == 7100  # flag beats YAML
    assert settings.metrics_port == 9100  # env beats YAML
    assert settings.pools.batch.max_batch == 32  # YAML beats default
    assert settings.pools.interactive.max_batch == 4 and settings.pools.interactive.max_wait_ms == 30
    assert settings.resume_grace_s == 30  # default


def test_settings_reject_overcommitted_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COALESCE_CONFIG", raising=False)
    monkeypatch.setenv("COALESCE_POOLS__BATCH__KV_SHARE", "0.9")
    with pytest.raises(ValueError, match=r"kv_share adds up to 1\.30"):
        load_settings()


def test_worker_flags_reach_spawned_workers() -> None:
    """A `coalesce serve` flag becomes the worker's setting, and worker_procs passes it on to each child."""
    from control_plane.worker_procs import worker_command
    from worker.config import WorkerSettings

    args = build_parser().parse_args(["serve", "--no-cpu-kernels", "--kv-cache-dtype", "int8"])
    settings = WorkerSettings().model_copy(update=_worker_overrides(args))
    assert (settings.cpu_kernels, settings.kv_cache_dtype) == (False, "int8")
    child = build_parser().parse_args(worker_command(settings, 50061)[3:])
    assert (child.cpu_kernels, child.kv_cache_dtype) == (False, "int8")
    assert build_parser().parse_args(["serve"]).cpu_kernels is None  # unset: the settings' default (on)
