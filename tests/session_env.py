"""The environment of the test session, set once when conftest imports this module.

Authentication is on in every server the tests start, as it is by default: one test token, known to the
servers through COALESCE_AUTH__TOKENS and sent by the clients through COALESCE_TOKEN (both inherited by the
processes tests spawn); raw gRPC stubs send `AUTH`. XDG_CONFIG_HOME points at a temporary folder, so no
test reads or writes the user's own local token (~/.config/coalesce/local-token).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

import grpc

TOKEN = "coalesce-test-token"
TENANT = "test"
AUTH = ("authorization", f"Bearer {TOKEN}")

os.environ["COALESCE_TOKEN"] = TOKEN
os.environ["COALESCE_AUTH__TOKENS"] = json.dumps({hashlib.sha256(TOKEN.encode()).hexdigest(): TENANT})
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="coalesce-test-config-")


def stranger_env() -> dict[str, str]:
    """The environment a user's shell would have: none of the session's tokens (a bench or command must set
    up its own auth, as it does outside the tests), and a fresh config folder of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("COALESCE_TOKEN", "COALESCE_AUTH__TOKENS")}
    env["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="coalesce-stranger-config-")
    return env


class _WithToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the test token to every call of a raw stub (as a user's own channel would)."""

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), AUTH]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: Any, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


def authed(channel: grpc.Channel) -> grpc.Channel:
    """`channel` with the test token on every call."""
    return grpc.intercept_channel(channel, _WithToken())
