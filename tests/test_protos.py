"""The protocol sources: generated code is fresh, buf lint is clean, the services are the ones named in
docs/architecture.md."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

from protos.coalesce.v1 import dedup_pb2, inference_pb2, worker_pb2

ROOT = Path(__file__).resolve().parents[1]

GENERATED = ROOT / "protos" / "coalesce" / "v1"


def _generate(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(out)


def _outputs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in [*folder.glob("*_pb2*.py*"), *folder.glob("*.binpb")]}


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    _generate(tmp_path)
    fresh = _outputs(tmp_path / "coalesce" / "v1")
    committed = _outputs(GENERATED)
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code, run `python scripts/gen_protos.py`: {stale}"


def test_buf_lint_standard_rules() -> None:
    buf = ROOT / "node_modules" / ".bin" / "buf"
    assert buf.exists(), "buf is missing: run `scripts/install.sh dev` (npm ci installs @bufbuild/buf)"
    result = subprocess.run([str(buf), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_services_and_methods() -> None:
    def methods(module: object, service: str) -> set[str]:
        return {m.name for m in module.DESCRIPTOR.services_by_name[service].methods}  # type: ignore[attr-defined]

    assert methods(inference_pb2, "InferenceService") == {
        "Generate", "Session", "Resume", "Cancel", "SubmitBatch", "GetBatch", "WatchBatch", "GetModelInfo",
    }  # fmt: skip
    assert methods(worker_pb2, "WorkerService") == {"Info", "Step"}
    assert methods(dedup_pb2, "DedupService") == {"Lookup", "Purge", "ListBatch"}
