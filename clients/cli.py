"""The `coalesce` command line: one subcommand per process kind, plus client and benchmark commands.

Imports of the heavy parts (torch, grpc servers) happen inside each command, so `--help` stays fast and a
command whose component is missing fails with one line instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCHES = ("worker_step", "serve_load", "dedup", "kv_cache", "kv_quality")
BUILTIN_NOTE = "the built-in model is random noise for demos and tests; --model DIR loads a Hugging Face checkpoint"


class CommandError(Exception):
    """A failure to report as one line on stderr with exit status 2 (bad input) or 1 (anything else)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _component(module: str, attr: str, what: str) -> Callable[..., Any]:
    """Import `module.attr`, or fail with a line naming what is missing."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            raise CommandError(f"{what} is not built yet (missing module {module})") from None
        raise
    fn = getattr(mod, attr, None)
    if fn is None:
        raise CommandError(f"{what} is not built yet (missing {module}.{attr})")
    return fn


def _settings(args: argparse.Namespace, **overrides: Any) -> Any:
    from control_plane.config import load_settings

    try:
        return load_settings(getattr(args, "config", None), **overrides)
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc).splitlines()[0] if isinstance(exc, FileNotFoundError) else str(exc), 2) from None


def _worker_overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("model", "device", "dtype", "kv_cache_mb", "kv_cache_dtype", "block_size")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def cmd_serve(args: argparse.Namespace) -> None:
    settings = _settings(
        args, host=args.host, port=args.port, workers=args.workers, metrics_port=args.metrics_port, store=args.store
    )
    settings.worker = settings.worker.model_copy(update=_worker_overrides(args))
    _component("control_plane.embedded", "run_serve", "`coalesce serve`")(settings, demo=args.demo)


def cmd_control_plane(args: argparse.Namespace) -> None:
    settings = _settings(
        args,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        store=args.store,
        worker_addresses=args.worker or None,
        workers=0,
    )
    if not settings.worker_addresses:
        raise CommandError("coalesce control-plane needs at least one --worker HOST:PORT", 2)
    _component("control_plane.embedded", "run_control_plane", "`coalesce control-plane`")(settings)


def cmd_worker(args: argparse.Namespace) -> None:
    settings = _settings(args)
    update = _worker_overrides(args) | {k: v for k in ("host", "port") if (v := getattr(args, k)) is not None}
    _component("worker.server", "run_worker", "`coalesce worker`")(settings.worker.model_copy(update=update))


def cmd_dedup_service(args: argparse.Namespace) -> None:
    settings = _settings(args, store=args.store)
    run = _component("dedup_service.server", "run_dedup_service", "`coalesce dedup-service`")
    run(settings.store, args.host, args.port)


def cmd_generate(args: argparse.Namespace) -> None:
    _component("clients.generate_cmd", "run", "`coalesce generate`")(args)


def cmd_batch(args: argparse.Namespace) -> None:
    _component("clients.batch_cmd", "run", "`coalesce batch`")(args)


def cmd_bench(args: argparse.Namespace) -> None:
    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.name}.py"
    if not script.is_file():
        raise CommandError(f"benchmark {args.name} is not built yet (missing {script})")
    raise SystemExit(subprocess.call([sys.executable, str(script), *args.bench_args]))


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"'builtin' (default) or a local checkpoint directory; {BUILTIN_NOTE}")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the model runs (default auto)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="weights' dtype")
    p.add_argument("--kv-cache-mb", type=int, help="KV cache budget in MiB (0: from free memory)")
    p.add_argument(
        "--kv-cache-dtype",
        choices=["model", "int8", "auto"],
        help="KV cache contents: the model's dtype (default), int8, or auto (int8 once memory runs short)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")


def _add_server_flags(p: argparse.ArgumentParser, port_help: str) -> None:
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help=port_help)
    p.add_argument("--config", help="YAML settings file (also COALESCE_CONFIG)")


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="control plane HOST:PORT")
    p.add_argument("--token", help="bearer token (tenant) sent as authorization metadata")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coalesce", description="LLM serving over gRPC with batching and dedup.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="run everything on this machine (embedded defaults)",
        description=f"Control plane + spawned workers + in-memory store. Note: {BUILTIN_NOTE}.",
    )
    _add_server_flags(p, "public gRPC port (default 50051; 0 picks a free one)")
    _add_worker_flags(p)
    p.add_argument("--workers", type=int, help="worker processes to spawn (default 1)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default off)")
    p.add_argument("--store", help="'memory' (default) or a redis:// URL")
    p.add_argument("--demo", action="store_true", help="send a few demo requests once serving, print them")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("control-plane", help="run the control plane against running workers")
    _add_server_flags(p, "public gRPC port (default 50051)")
    p.add_argument("--worker", action="append", metavar="HOST:PORT", help="a worker address (repeatable)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default off)")
    p.add_argument("--store", help="'memory' or a redis:// URL (shared by replicas)")
    p.set_defaults(func=cmd_control_plane)

    p = sub.add_parser("worker", help="run one worker (model + paged KV cache)", description=f"Note: {BUILTIN_NOTE}.")
    _add_server_flags(p, "worker gRPC port (default 50061; 0 picks a free one)")
    _add_worker_flags(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("dedup-service", help="run the operators' DedupService over the shared store")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50071, help="gRPC port (default 50071)")
    p.add_argument("--store", help="'memory' or a redis:// URL")
    p.add_argument("--config", help="YAML settings file")
    p.set_defaults(func=cmd_dedup_service)

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", help="prompt text")
    _add_client_flags(p)
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int, default=0, help="most tokens to generate (0: server default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--seed", type=int, help="sampling seed (same seed, same output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--idempotency-key", help="retries with the same key run once")
    p.add_argument("--pool", choices=["interactive", "batch"], default="interactive")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("batch", help="submit a batch job (JSON lines: {seq_id, prompt, max_tokens, ...})")
    p.add_argument("file", help="JSON-lines file of items")
    p.add_argument("--batch-id", required=True, help="resubmitting the same id skips items that succeeded")
    _add_client_flags(p)
    p.add_argument("--wait", action="store_true", help="watch until every item has ended, then print results")
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("bench", help="run a benchmark from bench/", description="Benchmarks: " + ", ".join(BENCHES))
    p.add_argument("name", choices=BENCHES)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except CommandError as exc:
        print(f"coalesce {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(exc.status) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
