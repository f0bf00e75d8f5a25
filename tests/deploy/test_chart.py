"""The chart renders and lints offline for its default values and for the GPU production values, every
manifest validates against the Kubernetes schemas (kubernetes-validate, strict), and values.schema.json
rejects values of the wrong type or with a misspelled key."""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from tests.deploy.chart_render import CHART, Manifest, chart, gpu_values, render
from tests.deploy.servicemonitor_schema import SERVICE_MONITOR

# The newest Kubernetes version kubernetes-validate ships schemas for; the chart's floor is in Chart.yaml.
KUBE_VERSION = latest_version()

# Every optional part on, and the other model sources: nothing the chart can render stays unchecked.
EVERYTHING_ON: dict[str, Any] = {
    "controlPlane": {"autoscaling": {"enabled": True}},
    "worker": {
        "model": {
            "source": "initContainer",
            "dir": "smol",
            "initContainer": {"image": "busybox:1.37", "command": ["true"]},
        }
    },
    "redis": {"auth": {"existingSecret": "redis-pass"}, "persistence": {"enabled": False}},
    "dedupService": {"enabled": True},
    "auth": {"tokens": {"a" * 64: "team-a"}},
    "tls": {"enabled": True, "existingSecret": "api-tls", "clientCA": True},
    "internalTls": {"enabled": True, "existingSecret": "internal-tls"},
    "jaeger": {"enabled": True},
    "serviceMonitor": {"enabled": True},
}
PVC_MODEL: dict[str, Any] = {
    "worker": {"model": {"source": "pvc", "dir": "llama", "pvc": {"claimName": "models", "subPath": "hf"}}}
}

PROFILES = {"default": {}, "gpu": gpu_values(), "everything-on": EVERYTHING_ON, "pvc-model": PVC_MODEL}


def validate(doc: Manifest) -> None:
    if doc["kind"] == "ServiceMonitor":
        jsonschema.validate(doc, SERVICE_MONITOR)
    else:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("profile", PROFILES)
def test_renders_and_every_manifest_validates(profile: str) -> None:
    docs = render(PROFILES[profile])
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= {d["kind"] for d in docs}
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("profile", ["default", "gpu"])
def test_lints_clean(profile: str) -> None:
    report = helm_python.lint(CHART, PROFILES[profile], strict=True, kube_version=f"v{KUBE_VERSION}")
    # strict: warnings count as errors. The one info-level hint left is "icon is recommended".
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_the_validator_is_live() -> None:
    """A misspelled field fails: the checks above are not passing vacuously."""
    doc = copy.deepcopy(next(d for d in render() if d["kind"] == "Deployment"))
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(doc)
    with pytest.raises(SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": "example.com/v1", "kind": "Nope", "metadata": {}}, KUBE_VERSION)
    monitor = next(d for d in render({"serviceMonitor": {"enabled": True}}) if d["kind"] == "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"worker": {"replicas": "two"}}, "/worker/replicas"),
        ({"controlPlane": {"drainSeconds": 1.5}}, "/controlPlane/drainSeconds"),
        ({"worker": {"gpu": -1}}, "/worker/gpu"),
        ({"worker": {"device": "tpu"}}, "/worker/device"),
        ({"redis": {"appendfsync": "no"}}, "/redis/appendfsync"),
        ({"config": {"pools": {"batch": {"max_batch": "many"}}}}, "/config/pools/batch/max_batch"),
        ({"controlPlane": {"replicaz": 3}}, "replicaz"),
        ({"auth": {"tokens": {"not-a-sha256": "team"}}}, "not-a-sha256"),
    ],
)
def test_schema_rejects(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        chart().validate_schema(values)
    with pytest.raises(helm_python.HelmValuesError, match=where):
        render(values)


def test_the_values_files_pass_the_schema() -> None:
    chart().validate_schema({})
    chart().validate_schema(gpu_values())


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis": {"enabled": False}}, "externalRedis.existingSecret is required"),
        ({"worker": {"model": {"source": "pvc"}}}, "worker.model.pvc.claimName is required"),
        ({"worker": {"model": {"source": "initContainer"}}}, "worker.model.initContainer.image is required"),
        ({"tls": {"enabled": True}}, "tls.existingSecret is required"),
        ({"internalTls": {"enabled": True}}, "internalTls.existingSecret is required"),
    ],
)
def test_missing_secret_or_source_fails_with_its_value_named(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)
