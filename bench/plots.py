"""The report's figures (matplotlib, Agg backend, small PNGs): each title names the machine and the date."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

DPI = 80


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One system at one offered load: what it achieved and its latencies (ms)."""

    system: str
    offered_tok_s: float
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float


def _save(fig: Figure, title: str, machine: str, path: Path) -> Path:
    fig.suptitle(f"{title}\n{machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _systems(points: list[LoadPoint]) -> dict[str, list[LoadPoint]]:
    out: dict[str, list[LoadPoint]] = {}
    for p in points:
        out.setdefault(p.system, []).append(p)
    return {k: sorted(v, key=lambda p: p.offered_tok_s) for k, v in out.items()}


def throughput(points: list[LoadPoint], machine: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 0.0
    for name, ps in _systems(points).items():
        ax.plot([p.offered_tok_s for p in ps], [p.tok_s for p in ps], marker="o", label=name)
        top = max(top, *(p.offered_tok_s for p in ps))
    ax.plot([0, top], [0, top], color="grey", linestyle=":", label="offered")
    ax.set_xlabel("offered load, tokens/s (Poisson arrivals)")
    ax.set_ylabel("achieved tokens/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, "Throughput vs offered load", machine, path)


def latency(points: list[LoadPoint], machine: str, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    panels = (("TTFT", "ttft_p50", "ttft_p99"), ("e2e", "e2e_p50", "e2e_p99"))
    for ax, (label, lo, hi) in zip(axes, panels, strict=True):
        for i, (name, ps) in enumerate(_systems(points).items()):
            x = [p.offered_tok_s for p in ps]
            color = f"C{i}"
            ax.plot(x, [getattr(p, lo) for p in ps], marker="o", color=color, label=f"{name} p50")
            ax.plot(x, [getattr(p, hi) for p in ps], marker="^", linestyle="--", color=color, label=f"{name} p99")
        ax.set_yscale("log")
        ax.set_xlabel("offered load, tokens/s")
        ax.set_ylabel(f"{label}, ms (log)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6)
    return _save(fig, "TTFT and end-to-end latency vs offered load (p50 solid, p99 dashed)", machine, path)


def max_wait(rows: list[tuple[float, float, float, float]], machine: str, path: Path) -> Path:
    """rows: (max_wait_ms, tok/s, TTFT p50 ms, TTFT p99 ms), one per value, on a symlog x axis."""
    rows = sorted(rows)
    waits = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(waits, [r[1] for r in rows], marker="o", color="C0", label="tokens/s")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xticks(waits, [f"{w:g}" for w in waits])
    ax.set_xlabel("interactive pool max_wait_ms")
    ax.set_ylabel("tokens/s", color="C0")
    twin = ax.twinx()
    twin.plot(waits, [r[2] for r in rows], marker="s", color="C1", label="TTFT p50")
    twin.plot(waits, [r[3] for r in rows], marker="^", linestyle="--", color="C3", label="TTFT p99")
    twin.set_ylabel("TTFT, ms")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [str(line.get_label()) for line in lines], fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return _save(fig, "Interactive pool max_wait_ms: throughput and TTFT", machine, path)


def timeline(samples: list[tuple[float, float, float]], label: str, machine: str, path: Path) -> Path:
    """samples: (seconds, KV blocks in use, running sequences)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    t = [s[0] for s in samples]
    ax.plot(t, [s[1] for s in samples], color="C0", label="KV blocks in use")
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV blocks in use", color="C0")
    twin = ax.twinx()
    twin.plot(t, [s[2] for s in samples], color="C1", label="running sequences (batch size)")
    twin.set_ylabel("running sequences", color="C1")
    ax.grid(alpha=0.3)
    return _save(fig, f"KV blocks in use and batch size over time ({label})", machine, path)
