"""Telemetry for the control plane (docs/observability.md): OTLP traces, Prometheus metrics, JSON event logs.

Everything here is optional: with no OTLP endpoint, no metrics port and text logs, `coalesce serve` runs the
base `control_plane.observer.Observer` and none of this is on the hot path.
"""
