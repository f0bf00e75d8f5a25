"""The machine a report ran on, in one line for its header and every figure's title: cores, CPU model,
device, torch threads, date, and the load average when asked (other processes skew every figure)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True)
class Machine:
    cores: int
    cpu: str
    device: str
    threads: int
    date: str  # UTC, day and minute the report started

    @classmethod
    def here(cls) -> Machine:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
        now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        return cls(os.cpu_count() or 1, cpu_model(), device, torch.get_num_threads(), now)

    @property
    def line(self) -> str:
        return f"{self.cores} cores, {self.cpu}, {self.device}, {self.threads} torch threads, {self.date}"

    @property
    def short(self) -> str:
        """For a figure title: the same without the thread count."""
        return f"{self.cores} cores {self.cpu}, {self.device}, {self.date}"


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min), {five:.2f} (5 min)"
