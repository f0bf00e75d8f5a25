"""The local token of `coalesce serve`: with no tokens configured (and auth not disabled), the embedded server
accepts one bearer token kept in a file only this user can read, and the CLI on this machine sends it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TENANT = "local"


def token_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "coalesce" / "local-token"


def read_local_token() -> str | None:
    try:
        return token_path().read_text().strip() or None
    except OSError:
        return None


def ensure_local_token() -> tuple[str, Path]:
    """The local token, created (mode 0600) on first use."""
    path = token_path()
    token = read_local_token()
    if token is None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return token, path
