"""Bearer tokens -> tenants: the tokens file (re-read when it changes, by an injected clock), inline tokens,
every way a call can fail to authenticate, and auth disabled explicitly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from security.settings import AuthSettings
from security.tokens import ANONYMOUS, Authenticator, Unauthenticated, digest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _write(path: Path, mapping: dict[str, str], mtime: int) -> None:
    path.write_text("".join(f"{h}: {t}\n" for h, t in mapping.items()))
    os.utime(path, ns=(mtime, mtime))  # a distinct mtime even within the file system's clock granularity


def test_tokens_map_to_tenants_and_anything_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    _write(path, {digest("alpha-secret"): "team-a"}, 1)
    auth = Authenticator(AuthSettings(tokens_file=str(path), tokens={digest("beta-secret"): "team-b"}))
    assert auth.tenant(_bearer("alpha-secret")) == "team-a"
    assert auth.tenant(_bearer("beta-secret")) == "team-b"
    refused = [(), _bearer("wrong"), (("authorization", "Basic YWxhZGRpbjpvcGVuc2VzYW1l"),), _bearer("")]
    for metadata in refused:
        with pytest.raises(Unauthenticated):
            auth.tenant(metadata)


def test_the_tokens_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path, clock = tmp_path / "tokens.yaml", Clock()
    _write(path, {digest("old"): "team-a"}, 1)
    auth = Authenticator(AuthSettings(tokens_file=str(path)), clock=clock)
    assert auth.tenant(_bearer("old")) == "team-a"
    _write(path, {digest("new"): "team-a"}, 2)  # the old token is revoked, a new one added
    clock.now += 2
    assert auth.tenant(_bearer("new")) == "team-a"
    with pytest.raises(Unauthenticated):
        auth.tenant(_bearer("old"))
    path.write_text("not: [a, mapping")  # a broken edit keeps the tokens loaded before
    os.utime(path, ns=(3, 3))
    clock.now += 2
    assert auth.tenant(_bearer("new")) == "team-a"


def test_an_empty_tokens_file_refuses_every_call(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("{}\n")
    auth = Authenticator(AuthSettings(tokens_file=str(path)))
    with pytest.raises(Unauthenticated):
        auth.tenant(_bearer("anything"))


@pytest.mark.parametrize(
    ("content", "problem"),
    [("- a list\n", "expected a mapping"), ("abc: team\n", "not a lowercase sha256"), (f"{'a' * 64}: ''\n", "tenant")],
)
def test_a_bad_tokens_file_is_one_clear_error_at_start(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=problem):
        Authenticator(AuthSettings(tokens_file=str(path)))
    with pytest.raises(ValueError, match="No such file"):
        Authenticator(AuthSettings(tokens_file=str(tmp_path / "missing.yaml")))


def test_disabled_auth_trusts_every_caller_and_keeps_tenants_apart_by_token() -> None:
    auth = Authenticator(AuthSettings(disabled=True))
    assert auth.tenant(()) == ANONYMOUS
    a, b = auth.tenant(_bearer("secret-a")), auth.tenant(_bearer("secret-b"))
    assert a != b and "secret" not in a  # a digest, never the token itself (tenants end up in store keys)
