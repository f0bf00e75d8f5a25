"""redis-py's errors as the store's one `StoreUnavailable`, with a message fit for callers.

Everything redis-py raises means, for a caller, that the store cannot do this now: unreachable, timing out,
loading, full (`maxmemory` with `noeviction`: OutOfMemoryError), read-only after a failover, busy running a
script, refusing our credentials. The control plane answers UNAVAILABLE and the caller retries. Only
`DataError` stays as it is: redis-py refusing an argument before sending it is a bug of ours.

Callers must not learn infrastructure addresses, and redis-py's client-side messages quote the host and port
("Error 111 connecting to 10.0.0.5:6379"), as do TLS hostname errors. So a client-side error is named by its
class only; an error the server answered (ResponseError) keeps the server's message, which names no address.
The address goes in `StoreUnavailable.where`, and the original error stays the exception's `__cause__`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from redis.exceptions import AskError, DataError, RedisError, ResponseError

from dedup_service.model import StoreUnavailable

P = ParamSpec("P")
T = TypeVar("T")


class HasAddress(Protocol):
    where: str  # the store's address, for operators only


S = TypeVar("S", bound=HasAddress)


def store_error(e: Exception, where: str) -> StoreUnavailable:
    """The StoreUnavailable a caller may see for `e` (a RedisError or OSError)."""
    name = type(e).__name__
    # AskError/MovedError (cluster redirects) name another node's address in their message.
    if isinstance(e, ResponseError) and not isinstance(e, AskError):
        return StoreUnavailable(f"redis store is unavailable: {name}: {e}", where)
    return StoreUnavailable(f"redis store is unavailable: {name}", where)


def unavailable(
    fn: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """Turn redis-py's errors (and socket errors under it) into StoreUnavailable (see the module doc)."""

    @functools.wraps(fn)
    async def run(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(self, *args, **kwargs)
        except DataError:
            raise
        except (RedisError, OSError) as e:
            raise store_error(e, self.where) from e

    return run
