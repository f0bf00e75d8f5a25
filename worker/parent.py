"""A worker spawned by `coalesce serve` dies with it: killed -9, the parent cannot stop its children, and an
orphaned worker would keep its port and its memory (on a GPU, the whole KV cache)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.5


def die_with(parent_pid: int) -> None:
    """SIGTERM this process when `parent_pid` is gone (it may be gone already)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    else:  # no parent-death signal: watch for the reparenting instead

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(POLL_S)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
