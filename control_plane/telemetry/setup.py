"""What `serve_control_plane` switches on, from the settings and the environment, in one object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from control_plane.config import Settings
from control_plane.dispatcher import Dispatcher
from control_plane.observer import Observer
from control_plane.telemetry.metrics import serve_metrics
from control_plane.telemetry.observer import TelemetryObserver
from control_plane.telemetry.tracing import TracingInterceptor, setup_tracing, shutdown_tracing


@dataclass
class Telemetry:
    """Tracing when OTEL_EXPORTER_OTLP_ENDPOINT is set, /metrics when metrics_port > 0, JSON event logs when
    log_format is json. With none of them, `observer` is the base no-op Observer and nothing else runs."""

    observer: Observer
    interceptors: list[grpc.aio.ServerInterceptor] = field(default_factory=list)
    _stop_metrics: Callable[[], None] | None = None

    @classmethod
    def start(cls, settings: Settings) -> Telemetry:
        """Call inside the running loop, after worker processes were spawned (the exporter opens a channel)."""
        tracing = setup_tracing() is not None
        events = settings.log_format == "json"
        if not (tracing or events or settings.metrics_port):
            return cls(Observer())
        observer = TelemetryObserver.create(events=events, tracing=tracing)
        telemetry = cls(observer, [TracingInterceptor()] if tracing else [])
        if settings.metrics_port:
            telemetry._stop_metrics = serve_metrics(observer.metrics, settings.metrics_port, settings.host)
        return telemetry

    def bind(self, dispatcher: Dispatcher) -> None:
        """After `dispatcher.start()`: the model name and the workers' scheduler state become known."""
        if isinstance(self.observer, TelemetryObserver):
            self.observer.bind(dispatcher)

    def stop(self) -> None:
        if self._stop_metrics is not None:
            self._stop_metrics()
        shutdown_tracing()
