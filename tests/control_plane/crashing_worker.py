"""A real worker process (builtin model) that dies, as a segfault would kill it, at any step holding a prompt
token given on the command line; tests/control_plane/test_step_failure.py restarts it on the same port.

    python tests/control_plane/crashing_worker.py PORT POISON_TEXT
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenizers import Tokenizer

from protos.coalesce.v1 import worker_pb2
from worker.config import WorkerSettings
from worker.engine import Engine
from worker.runner import ModelRunner
from worker.server import serve_worker


class CrashingEngine(Engine):
    poison_id = -1

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        if any(self.poison_id in work.token_ids for work in req.seqs):
            os._exit(1)
        return super().step(req)


def main() -> None:
    port, poison = int(sys.argv[1]), sys.argv[2]
    settings = WorkerSettings(
        model="builtin", device="cpu", dtype="float32", host="127.0.0.1", port=port, kv_cache_mb=8
    )
    engine = CrashingEngine(ModelRunner.from_settings(settings))
    tokenizer = Tokenizer.from_str(engine.runner.loaded.tokenizer_json.decode())
    (CrashingEngine.poison_id,) = tokenizer.encode(poison, add_special_tokens=False).ids
    asyncio.run(serve_worker(settings, engine=engine))


if __name__ == "__main__":
    main()
