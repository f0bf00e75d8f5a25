"""The security settings, part of the service-wide settings (control_plane/config.py) and of a worker's."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ConfigError(ValueError):
    """A security setting that cannot work (a missing file, a bad tokens file): one line, at start."""


class AuthSettings(BaseModel):
    """Bearer tokens of the public API (and the DedupService), each mapped to a tenant."""

    # Explicitly off: every caller is trusted; the tenant is a digest of whatever bearer token it sends.
    disabled: bool = False
    # A YAML mapping of sha256(token) in hex -> tenant name, re-read when it changes. `{}` refuses every call.
    tokens_file: str = ""
    # The same mapping inline (e.g. COALESCE_AUTH__TOKENS='{"<sha256 hex>": "team-a"}').
    tokens: dict[str, str] = Field(default_factory=dict)

    @property
    def configured(self) -> bool:
        return bool(self.tokens_file or self.tokens)


class TlsSettings(BaseModel):
    """TLS of the public port. With `client_ca_file`, callers must also present a certificate it signed."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


class InternalTlsSettings(BaseModel):
    """mTLS between the control plane and its workers (and the DedupService): both sides present a
    certificate signed by `ca_file` and verify the other's."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    # The name the workers' certificates carry, checked when they are dialled by IP (e.g. found through DNS).
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file and self.cert_file and self.key_file)
