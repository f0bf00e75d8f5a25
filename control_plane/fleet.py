"""The workers found by DNS, and which of them this replica drives (docs/architecture.md, "Workers and
replicas").

`worker_dns` ("name:port") is looked up every third of `lease_s`: each A or AAAA record (of a Kubernetes
headless Service, say) is a ready worker. The replicas that find the same workers share them: a worker runs
one scheduler session at a time, so with a shared store each is owned by one replica through a lease in the
store, renewed at each look-up. Each replica holds at most its fair share (rounded up); one above it gives a
worker up while another replica is below it; when a replica dies its leases run out and the others take its
workers. With the memory store (one replica) every worker found is driven. Workers in the static list
(`worker_addresses`) are this replica's alone and never shared (the dispatcher drives them from the start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable

import dns.asyncresolver
import dns.exception
import dns.resolver

from control_plane.config import Settings
from control_plane.dispatcher import Dispatcher
from dedup_service import Store, StoreUnavailable

log = logging.getLogger(__name__)

Resolve = Callable[[str], Awaitable[list[str]]]


def share(workers: list[str], owners: dict[str, str], replicas: list[str], me: str) -> tuple[list[str], list[str]]:
    """(claim, release) for replica `me`: claim free workers up to its fair share; give extra ones up while
    another replica is below its share. Pure: the store arbitrates concurrent claims."""
    replicas = sorted({*replicas, me})
    target = math.ceil(len(workers) / len(replicas))
    mine = sorted(w for w in workers if owners.get(w) == me)
    free = sorted(w for w in workers if w not in owners)
    claim = free[: max(0, target - len(mine))]
    held = Counter(owners[w] for w in workers if w in owners)
    starved = any(held[r] < len(workers) // len(replicas) for r in replicas if r != me)
    release = mine[target:] if starved else []
    return claim, release


def dns_resolver(server: str = "") -> Resolve:
    """Look up "name:port" as A and AAAA records; `server` ("host:port") instead of the system's resolver."""
    resolver = dns.asyncresolver.Resolver(configure=not server)
    if server:
        host, _, port = server.rpartition(":")
        resolver.nameservers, resolver.port = [host], int(port)

    async def resolve(target: str) -> list[str]:
        name, _, port = target.rpartition(":")
        found: list[str] = []
        for kind in ("A", "AAAA"):
            with contextlib.suppress(dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                answer = await resolver.resolve(name, kind, lifetime=5)
                found += [f"[{r.address}]:{port}" if kind == "AAAA" else f"{r.address}:{port}" for r in answer]
        return found

    return resolve


class Fleet:
    def __init__(self, dispatcher: Dispatcher, store: Store, owner: str, settings: Settings,
                 resolve: Resolve | None = None) -> None:  # fmt: skip
        self.dispatcher = dispatcher
        self.store = store
        self.owner = owner
        self.settings = settings
        self.resolve = resolve or dns_resolver(settings.worker_dns_server)

    async def run(self) -> None:
        while True:
            try:
                await self.turn()
            except (StoreUnavailable, dns.exception.DNSException, OSError) as exc:
                log.warning("worker discovery/ownership: %s; keeping the workers driven now", exc)
            await asyncio.sleep(self.settings.lease_s / 3)

    async def turn(self) -> None:
        """Look the workers up, then drive exactly those this replica owns."""
        if self.store.shared:  # counted among the replicas from the first turn (the journal beats it too)
            await self.store.heartbeat(self.owner, self.settings.lease_s)
        found = [a for a in await self.resolve(self.settings.worker_dns) if a not in self.settings.worker_addresses]
        driven = {link.address for link in self.dispatcher.links if link.address not in self.settings.worker_addresses}
        if self.store.shared:
            owners = await self.store.worker_owners()
            claim, release = share(found, owners, await self.store.replicas(), self.owner)
            for address in release:  # hand it over: stop its session here first, then free the lease
                await self._retire(address, "handed over to another replica")
                driven.discard(address)
                await self.store.release_worker(address, self.owner)
            lease, mine = self.settings.lease_s, [a for a in found if owners.get(a) == self.owner]
            wanted = {
                a for a in [*mine, *claim] if a not in release and await self.store.claim_worker(a, self.owner, lease)
            }
        else:
            wanted = set(found)
        for address in sorted(wanted - driven):
            log.info("worker %s: driving it", address)
            self.dispatcher.add_link(address)
        for address in sorted(driven - wanted):
            await self._retire(address, "gone, or owned by another replica now")

    async def _retire(self, address: str, why: str) -> None:
        log.info("worker %s: %s; its sequences move to the other workers", address, why)
        await self.dispatcher.retire_link(address)
