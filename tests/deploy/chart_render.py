"""The Helm chart rendered offline (helm-python-sdk, Helm v4 as a library): manifests as dicts, and what the
containers run. Also for a local test that wants to start exactly the chart's processes."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from helm_python import Chart

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "coalesce"
GPU_VALUES = CHART / "values-gpu.yaml"
RELEASE, NAMESPACE = "coalesce", "llm"

Manifest = dict[str, Any]


@functools.cache
def chart() -> Chart:
    return Chart.load(CHART)


def gpu_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(GPU_VALUES.read_text())
    return values


def render(values: dict[str, Any] | None = None) -> list[Manifest]:
    """Every manifest the chart renders with `values` over its defaults (NOTES.txt left out)."""
    out = chart().render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs: list[Manifest] = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    have = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} rendered; have {have}"
    return hits[0]


def pod_specs(docs: list[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    """(workload, pod spec) of every Deployment and StatefulSet."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d, d["spec"]["template"]["spec"]


def config_yaml(docs: list[Manifest]) -> dict[str, Any]:
    """The config.yaml every Coalesce process reads."""
    cm = find(docs, "ConfigMap", f"{RELEASE}-config")
    config: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return config


def coalesce_commands(docs: list[Manifest]) -> dict[str, list[str]]:
    """Container name -> argv, for every container that runs the `coalesce` CLI."""
    commands = {}
    for _, spec in pod_specs(docs):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            argv = list(c.get("command", [])) + list(c.get("args", []))
            if argv[:1] == ["coalesce"]:
                commands[c["name"]] = argv
    return commands
