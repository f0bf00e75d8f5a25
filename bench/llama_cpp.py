"""llama.cpp as a peer for the CPU benchmarks: its binaries, built once from the vendored source in the
`llama-cpp-python` sdist (PyPI); its `llama-batched-bench` output parsed into decode tok/s per batch; and
`llama-server` (continuous batching over `slots` slots) driven by a closed loop of HTTP completions.

The build is CPU only, Release, into ~/.cache/coalesce/llama.cpp/<version>; a second call finds it there.
No torch here, so importing it is cheap.

    .venv/bin/python -m bench.llama_cpp            # build (if needed) and print the binary paths
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (`python bench/llama_cpp.py`), the repo root is not on the path
    sys.path.insert(0, str(ROOT))

from bench.common import interrupt  # noqa: E402

CACHE = Path(os.environ.get("COALESCE_CACHE", Path.home() / ".cache" / "coalesce")) / "llama.cpp"
TARGETS = ("llama-batched-bench", "llama-server")
SDIST = re.compile(r"llama_cpp_python-(.+)\.tar\.gz$")


def download_sdist(dest: Path) -> Path:
    """The newest llama-cpp-python sdist, via pip (the ordinary client), into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    subprocess.run([*cmd, "-d", str(dest), "llama-cpp-python"], check=True, stdout=subprocess.DEVNULL)
    found = [p for p in dest.iterdir() if SDIST.search(p.name)]
    if not found:
        raise RuntimeError(f"pip download left no llama-cpp-python sdist in {dest}")
    return found[0]


def unpack_vendor(sdist: Path, dest: Path) -> Path:
    """Extract only the sdist's vendor/llama.cpp tree into `dest`; returns the llama.cpp source dir."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(dest, members=[m for m in members if m.name], filter="data")
    return dest


def binaries(directory: Path) -> dict[str, Path]:
    return {t: directory / "build" / "bin" / t for t in TARGETS}


def cached() -> dict[str, Path] | None:
    """The binaries of a finished build in the cache, if any (the newest version directory)."""
    if not CACHE.is_dir():
        return None
    for version in sorted(CACHE.iterdir(), reverse=True):
        bins = binaries(version)
        if all(p.is_file() for p in bins.values()):
            return bins
    return None


def build(jobs: int = 2, log: object = sys.stderr) -> dict[str, Path]:
    """Paths of llama-batched-bench and llama-server; downloads and builds them the first time (~5 min on
    2 cores)."""
    if (found := cached()) is not None:
        return found
    with tempfile.TemporaryDirectory() as tmp:
        sdist = download_sdist(Path(tmp))
        m = SDIST.search(sdist.name)
        assert m is not None
        target = CACHE / m.group(1)
        if not (target / "CMakeLists.txt").is_file():
            if target.exists():
                shutil.rmtree(target)
            unpack_vendor(sdist, target)
    print(f"building llama.cpp in {target} (CPU, Release, -j{jobs}) ...", file=log, flush=True)  # type: ignore[call-overload]
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DLLAMA_CURL=OFF"]
    flags += ["-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON"]
    subprocess.run(["cmake", "-S", str(target), "-B", str(target / "build"), *flags], check=True)
    subprocess.run(
        ["cmake", "--build", str(target / "build"), "--config", "Release", "-j", str(jobs), "--target", *TARGETS],
        check=True,
    )
    return binaries(target)


# llama-batched-bench prints a markdown table:
# |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|([^\n]*)$", re.M)


def parse_batched_bench(text: str) -> dict[int, float]:
    """Decode (text generation) tok/s per batch size from llama-batched-bench's output."""
    out: dict[int, float] = {}
    for m in ROW.finditer(text):
        cells = [c.strip() for c in m.group(5).split("|") if c.strip()]
        # T_PP, S_PP, T_TG, S_TG, T, S
        if len(cells) >= 4:
            out[int(m.group(3))] = float(cells[3])
    return out


def batched_bench(
    gguf: Path, batches: list[int], prompt: int, generated: int, threads: int, binary: Path | None = None
) -> dict[int, float]:
    """Run llama-batched-bench on `gguf` (same prompts per sequence, not shared) and return decode tok/s per batch."""
    exe = binary or build()["llama-batched-bench"]
    ctx = max(batches) * (prompt + generated) + 16
    cmd = [str(exe), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads)]
    cmd += ["-tb", str(threads), "-npp", str(prompt), "-ntg", str(generated), "-npl", ",".join(map(str, batches))]
    cmd += ["-ngl", "0"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return parse_batched_bench(done.stdout + done.stderr)


@contextmanager
def llama_server(gguf: Path, slots: int, slot_ctx: int, threads: int, port: int) -> Iterator[str]:
    """`llama-server` on 127.0.0.1:`port` with `slots` slots of `slot_ctx` tokens each; yields its base URL
    once /health answers, stops it with SIGINT."""
    exe = build()["llama-server"]
    cmd = [str(exe), "-m", str(gguf), "-np", str(slots), "-c", str(slots * slot_ctx), "-t", str(threads)]
    cmd += ["-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), "-ngl", "0", "--no-webui"]
    # A file, not a pipe, for its log: a full pipe would stall the server.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"llama-server exited {proc.returncode}: {log.read()[-3000:]}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not become healthy in 120 s")
                time.sleep(0.5)
            yield url
        finally:
            interrupt(proc)


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """One greedy completion of `prompt` (token ids) for exactly max_tokens tokens (ignore_eos), through the
    OpenAI-compatible /v1/completions; (seconds, tokens generated)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": False}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - t0, int(out["usage"]["completion_tokens"])


def closed_loop(url: str, work: list[tuple[list[int], int]], concurrency: int) -> tuple[float, int, list[float]]:
    """`concurrency` clients, each sending the next (prompt, max_tokens) when its own ends: (span seconds,
    tokens generated, each request's seconds)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda w: complete(url, *w), work))
    return time.perf_counter() - t0, sum(n for _, n in done), [s for s, _ in done]


if __name__ == "__main__":
    # No options, but --help must explain rather than start a ten-minute build.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for name, path in build().items():
        print(f"{name}: {path}")
