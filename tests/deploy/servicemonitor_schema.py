"""A JSON schema for the ServiceMonitor fields this chart uses (monitoring.coreos.com/v1, prometheus-operator's
API reference). kubernetes-validate ships schemas for built-in kinds only; this keeps the one custom resource
the chart renders checked too, strictly: an unknown or misspelled field fails."""

from __future__ import annotations

from typing import Any

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": "^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}

SERVICE_MONITOR: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "labels": _STR_MAP, "annotations": _STR_MAP},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _STR_MAP, "matchExpressions": {"type": "array"}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": _DURATION,
                            "scheme": {"enum": ["http", "https"]},
                        },
                    },
                },
            },
        },
    },
}
