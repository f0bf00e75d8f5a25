"""C++ kernels compiled on first use into a shared library cached by content, loaded with ctypes.

No torch headers and no build step at install: a kernel file compiles with the system's g++ in a second or
two. The cache key covers the sources (all of this folder's: one may include another), the flags, the compiler
and this CPU's feature flags (the code is built with -march=native), so a cache directory shared by machines
never serves a foreign build. Without a
compiler, or when compiling fails, `load` returns None and callers keep their torch code path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from worker.config import default_cache_dir

log = logging.getLogger(__name__)

# 256-bit vectors even where AVX-512 is there: with 512-bit ones the int8 decode (its int8 -> float conversions)
# ran 1.8x slower on an AVX-512 Xeon, and float32 rows 10 % slower (docs/kv_cache.md).
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """worker/kernels/<name>.cpp as a loaded library, compiled once per source and machine; None if it cannot be."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler: the %s kernels are off (torch fallback)", name)
        return None
    source = Path(__file__).with_name(f"{name}.cpp")
    # Every source here, not only this one: a kernel may #include the others (decode_step.cpp does).
    sources = [f.read_text() for f in sorted(source.parent.glob("*.[ch]*")) if f.suffix in (".cpp", ".h")]
    text = "\0".join([source.name, *sources, *FLAGS, compiler, _cpu_flags()])
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    target = default_cache_dir() / "kernels" / f"{name}-{key}.so"
    try:
        if not target.exists():
            _compile(compiler, source, target)
        return ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        log.warning("compiling %s failed, its kernels are off (torch fallback):\n%s", source, e.stderr)
    except OSError as e:  # an unwritable cache directory, a library that does not load
        log.warning("the %s kernels are off (torch fallback): %s", name, e)
    return None


def _compile(compiler: str, source: Path, target: Path, flags: list[str] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed into place: concurrent workers never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
