"""What `coalesce serve` settles before anything starts (light imports only: the CLI runs this, spawns the
workers, and only then imports the control plane, so the models load meanwhile).

- With no tokens configured and auth not disabled, the API accepts the local token, kept in a file only
  this user can read, which the CLI and the Python client on this machine send by default.
- The workers serve only this process: a fresh shared secret, passed in their environment.
"""

from __future__ import annotations

from control_plane.config import Settings
from security.internal import TOKEN_ENV, new_token
from security.local_token import TENANT as LOCAL_TENANT
from security.local_token import ensure_local_token
from security.settings import AuthSettings
from security.tokens import digest


def prepare(settings: Settings) -> Settings:
    if not (settings.auth.disabled or settings.auth.configured):
        token, path = ensure_local_token()
        print(f"auth: accepting the local token in {path} (tenant {LOCAL_TENANT!r}); see docs/security.md", flush=True)
        settings = settings.model_copy(update={"auth": AuthSettings(tokens={digest(token): LOCAL_TENANT})})
    return settings.model_copy(update={"internal_token": settings.internal_token or new_token()})


def worker_env(settings: Settings) -> dict[str, str]:
    """What the spawned workers add to this process's environment."""
    return {TOKEN_ENV: settings.internal_token}
