"""Bearer tokens -> tenants. A token is never stored: the table maps sha256(token) hex digests to tenant
names, from a YAML file re-read when it changes (so tokens are added or revoked without a restart) and/or
from the settings. With auth disabled (explicitly), every caller is trusted and the tenant is a digest of
whatever bearer token it sends, as before authentication existed."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from security.settings import AuthSettings, ConfigError

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str | bytes]]
DIGEST = re.compile(r"[0-9a-f]{64}")
ANONYMOUS = "default"
RECHECK_S = 1.0  # the tokens file is stat'ed at most this often


class Unauthenticated(Exception):
    """The call carries no valid bearer token (the servers answer UNAUTHENTICATED with this message)."""


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(metadata: Metadata | None) -> str | None:
    """The bearer token of a call's `authorization` metadata, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip() or None
    return None


def load_table(path: Path) -> dict[str, str]:
    """Parse a tokens file: a YAML mapping of sha256 hex digest -> tenant. Raises ValueError naming the problem."""
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sha256 hex digests to tenant names")
    table = {}
    for hashed, tenant in data.items():
        if not isinstance(hashed, str) or not DIGEST.fullmatch(hashed):  # quote digests: YAML reads 0123 as 123
            raise ConfigError(f"{path}: {hashed!r} is not a lowercase sha256 hex digest of a token (quote it)")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{path}: the tenant of {hashed[:12]}... must be a non-empty string")
        table[hashed] = tenant
    return table


@dataclass
class Authenticator:
    """Who is calling: `tenant(metadata)` or Unauthenticated."""

    settings: AuthSettings
    clock: Callable[[], float] = time.monotonic
    _file: dict[str, str] = field(default_factory=dict)
    _stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the file as last read
    _checked: float = float("-inf")

    def __post_init__(self) -> None:
        for hashed in self.settings.tokens:
            if not DIGEST.fullmatch(hashed):
                raise ConfigError(f"auth.tokens: {hashed!r} is not a lowercase sha256 hex digest of a token")
        if self.settings.tokens_file:
            self._reload(force=True)

    def tenant(self, metadata: Metadata | None) -> str:
        token = bearer(metadata)
        if self.settings.disabled:
            return "t-" + digest(token)[:24] if token else ANONYMOUS
        if token is None:
            raise Unauthenticated("this call needs an `authorization: Bearer <token>` header")
        tenant = self._lookup(digest(token))
        if tenant is None:
            raise Unauthenticated("the bearer token is not valid")
        return tenant

    def _lookup(self, hashed: str) -> str | None:
        if self.settings.tokens_file:
            self._reload()
        # Looked up by digest: what a caller controls (the token) never meets a comparison directly.
        return self.settings.tokens.get(hashed) or self._file.get(hashed)

    def _reload(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._checked < RECHECK_S:
            return
        self._checked = now
        path = Path(self.settings.tokens_file)
        try:
            st = os.stat(path)
        except OSError as exc:
            if force:
                raise ConfigError(f"auth.tokens_file {path}: {exc.strerror}") from None
            log.warning("tokens file %s is unreadable (%s); keeping the tokens loaded before", path, exc.strerror)
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            self._file = load_table(path)
        except (ValueError, yaml.YAMLError) as exc:
            if force:
                raise ConfigError(f"{path}: {exc}" if isinstance(exc, yaml.YAMLError) else str(exc)) from None
            log.warning("tokens file %s is invalid (%s); keeping the tokens loaded before", path, exc)
            return
        self._stamp = stamp
        log.info("tokens file %s: %d token(s)", path, len(self._file))
