"""The service's one settings object.

Precedence, highest first: CLI flags (passed as keyword overrides), environment variables `COALESCE_*`
(nested with `__`, e.g. `COALESCE_POOLS__BATCH__MAX_BATCH=128`), the YAML file (`--config FILE` or
`COALESCE_CONFIG`), then the defaults below.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from security.settings import AuthSettings, InternalTlsSettings, TlsSettings
from worker.config import WorkerSettings


class PoolSettings(BaseModel):
    """One scheduling pool (docs/architecture.md, "Scheduling")."""

    # Most sequences of this pool running at once on one worker.
    max_batch: int = Field(ge=1)
    # Longest a request waits in the batch buffer for others to join its prefill.
    max_wait_ms: float = Field(ge=0)
    # Hard share of each worker's KV blocks this pool may hold.
    kv_share: float = Field(gt=0, le=1)
    # Whether responses are streamed by default.
    stream: bool
    # Most requests waiting in this pool's queue; past it, RESOURCE_EXHAUSTED.
    max_queue: int = Field(default=1024, ge=1)
    # Most requests of one tenant in this pool (waiting or running, on this replica); past it,
    # RESOURCE_EXHAUSTED TENANT_LIMIT, so no tenant can fill the queue for the others.
    max_per_tenant: int = Field(default=256, ge=1)


POOL_DEFAULTS: dict[str, dict[str, Any]] = {
    "interactive": {"max_batch": 8, "max_wait_ms": 30, "kv_share": 0.4, "stream": True},
    "batch": {
        "max_batch": 64,
        "max_wait_ms": 300,
        "kv_share": 0.6,
        "stream": False,
        "max_queue": 10000,
        "max_per_tenant": 10000,
    },
}


class PoolsSettings(BaseModel):
    interactive: PoolSettings = PoolSettings(**POOL_DEFAULTS["interactive"])
    batch: PoolSettings = PoolSettings(**POOL_DEFAULTS["batch"])

    @model_validator(mode="before")
    @classmethod
    def _fill_from_defaults(cls, data: Any) -> Any:
        # A file or env var may set one field of a pool (COALESCE_POOLS__BATCH__MAX_BATCH): keep the rest.
        if isinstance(data, dict):
            return {
                name: POOL_DEFAULTS[name] | dict(value) if name in POOL_DEFAULTS and isinstance(value, dict) else value
                for name, value in data.items()
            }
        return data


class SchedulerSettings(BaseModel):
    # Most tokens (prefill chunks + decodes) in one step.
    max_step_tokens: int = Field(default=512, ge=1)
    # Prefills grouped in one step keep longest/shortest <= this.
    prefill_ratio: float = Field(default=4.0, ge=1)
    # Worker choice: merge_weight * prefix_match_fraction - normalized_load.
    merge_weight: float = Field(default=1.0, ge=0)


class Settings(BaseSettings):
    """Everything `coalesce serve` / `control-plane` / `worker` / `dedup-service` need."""

    model_config = SettingsConfigDict(env_prefix="COALESCE_", env_nested_delimiter="__", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=50051, ge=0, le=65535)
    # Prometheus /metrics port; 0 means off.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # Log lines: "text" (human-readable) or "json" (one object per line, with request events and trace ids).
    log_format: Literal["text", "json"] = "text"
    # Workers `coalesce serve` spawns as child processes.
    workers: int = Field(default=1, ge=0, le=64)
    # Addresses (host:port) of workers started elsewhere; used by `coalesce control-plane`.
    worker_addresses: list[str] = Field(default_factory=list)
    worker: WorkerSettings = WorkerSettings()
    pools: PoolsSettings = PoolsSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    # "memory" (embedded default, one replica) or a redis:// URL (shared by replicas).
    store: str = "memory"
    # Keep idempotent results this long for replay.
    idempotency_retention_s: float = Field(default=86400, gt=0)
    # Lease of an INIT/PROCESSING record, renewed by heartbeat while the run is alive.
    lease_s: float = Field(default=10, gt=0)
    # A dropped stream keeps generating this long; the token log is kept this long after finish.
    resume_grace_s: float = Field(default=30, ge=0)
    # Serve keyed requests without the store when it is down (risks duplicate inference).
    dedup_fail_open: bool = False
    # max_tokens when the request leaves it 0.
    default_max_tokens: int = Field(default=256, ge=1)
    max_stop_strings: int = Field(default=16, ge=0)
    max_stop_token_ids: int = Field(default=64, ge=0)
    # Generations (and resumes) open at once on one Session stream; past it, RESOURCE_EXHAUSTED per stream.
    session_max_streams: int = Field(default=256, ge=1)
    # Messages a Session buffers for a caller that reads slowly; when full, the session stops reading
    # the caller's requests and pauses its streams (gRPC flow control pushes back).
    session_buffer: int = Field(default=64, ge=1)
    # Largest request message accepted, in bytes.
    max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # Who may call the public API (bearer tokens -> tenants), and TLS of the public port (docs/security.md).
    auth: AuthSettings = AuthSettings()
    tls: TlsSettings = TlsSettings()
    # What a worker requires of its control plane: mTLS and/or this shared secret (COALESCE_INTERNAL_TOKEN).
    internal_tls: InternalTlsSettings = InternalTlsSettings()
    internal_token: str = Field(default="", repr=False)

    @model_validator(mode="after")
    def _shares_fit(self) -> Settings:
        total = self.pools.interactive.kv_share + self.pools.batch.kv_share
        if total > 1.0 + 1e-9:
            raise ValueError(f"pools' kv_share adds up to {total:.2f}; it must be at most 1")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = os.environ.get("COALESCE_CONFIG")
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if yaml_file:
            sources += (YamlConfigSettingsSource(settings_cls, yaml_file=Path(yaml_file)),)
        return sources


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Build the settings: flags (overrides; None values are ignored) > env > YAML > defaults."""
    if config_file is not None:
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"config file not found: {config_file}")
        os.environ["COALESCE_CONFIG"] = config_file
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
