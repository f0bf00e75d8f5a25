"""gRPC credentials from the TLS settings: the public port, and mTLS between the control plane and its
workers (and the DedupService). Files are read once, at start; a missing or unreadable one is one clear error."""

from __future__ import annotations

from pathlib import Path

import grpc

from security.settings import ConfigError, InternalTlsSettings, TlsSettings


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None


def public_server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """The public port's certificate; with a client CA, callers must present a certificate it signed."""
    if not tls.key_file:
        raise ConfigError("tls.cert_file is set but tls.key_file is not")
    pair = (_read(tls.key_file, "tls.key_file"), _read(tls.cert_file, "tls.cert_file"))
    ca = _read(tls.client_ca_file, "tls.client_ca_file") if tls.client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def internal_server_credentials(tls: InternalTlsSettings) -> grpc.ServerCredentials:
    """A worker's (or the DedupService's) side of mTLS: only callers with a certificate the CA signed."""
    pair = (_read(tls.key_file, "internal_tls.key_file"), _read(tls.cert_file, "internal_tls.cert_file"))
    ca = _read(tls.ca_file, "internal_tls.ca_file")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=True)


def internal_channel_credentials(tls: InternalTlsSettings) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    """The control plane's side of mTLS, and the channel options that check the workers' certificate name."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file, "internal_tls.ca_file"),
        private_key=_read(tls.key_file, "internal_tls.key_file"),
        certificate_chain=_read(tls.cert_file, "internal_tls.cert_file"),
    )
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return creds, options


def client_channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """A client of the public port: trust `ca_file` (default: the system's roots), present a certificate when
    the server requires one."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "CA file") if ca_file else None,
        private_key=_read(key_file, "key file") if key_file else None,
        certificate_chain=_read(cert_file, "certificate file") if cert_file else None,
    )
