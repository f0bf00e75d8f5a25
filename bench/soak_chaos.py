"""The soak's chaos (bench/soak.py): one event every few seconds, cycling through the kinds below, while the
good tenant's load runs. Each event does its harm, checks what it must (docs/deploy.md, "Failure modes"), and
returns one line saying what it did.

- worker-kill: kill -9 a worker; it is started again on its port, and its control plane reconnects and
  recomputes what ran there.
- replica-kill: kill -9 a control plane; a new one starts on another port (its worker stays). Its streams move
  to the other replica, whose Resume follows the store's log and takes the requests over when their leases end.
- redis-aof / redis-empty: kill -9 Redis and start it again from its AOF / empty (no persistence). A keyed
  probe that succeeded before must be replayed after an AOF restart; after an empty one the key is forgotten
  and runs again. Either way running streams complete exactly: the journal claims lost requests again.
- disconnect-storm: many streams opened on both replicas, dropped mid-way by closing their channels (no
  Cancel); half of them resumed, on the other replica where there is one, and checked exactly.
- hostile-tenant: a Session asking thousands of Resumes, held unread for a while (flow control must bound the
  server), while the same tenant floods one replica past its per-tenant limit (refusals expected); the good
  tenant must complete requests meanwhile.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from bench.soak_cluster import Redis, Replica, rss_kib
from bench.soak_load import GREEDY, Load, Prompt, carry, error_name
from clients.aio import AsyncCoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError, session_error
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

KINDS = ("worker-kill", "redis-aof", "replica-kill", "disconnect-storm", "redis-empty", "hostile-tenant")


@dataclass(frozen=True, slots=True)
class Sizes:
    storm: int  # streams per disconnect storm
    resumes: int  # Resumes the hostile session asks
    flood: int  # concurrent requests of the hostile flood (beyond max_per_tenant)
    hold_s: float  # how long the hostile session stays unread
    # The storm's keyless streams: "auto" lets identical ones share a computation (the server's default),
    # "off" computes each alone.
    storm_dedup: str = "auto"


@dataclass(slots=True)
class Dropped:
    """A stream of the disconnect storm, as it was when its channel was closed."""

    prompt: Prompt
    where: int  # index in the live addresses
    has_key: bool
    tokens: list[int] = field(default_factory=list)
    request_id: str | None = None
    finish: str | None = None
    outcome: str | None = None


@dataclass(slots=True)
class Event:
    at_s: float
    kind: str
    took_s: float
    did: str
    ok: bool


class Chaos:
    def __init__(self, redis: Redis, replicas: list[Replica], load: Load, sizes: Sizes, seed: int) -> None:
        self.redis = redis
        self.replicas = replicas
        self.load = load
        self.sizes = sizes
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.events: list[Event] = []
        self.actions: dict[str, Callable[[], Awaitable[str]]] = {
            "worker-kill": self.worker_kill,
            "replica-kill": self.replica_kill,
            "redis-aof": lambda: self.redis_restart(persisted=True),
            "redis-empty": lambda: self.redis_restart(persisted=False),
            "disconnect-storm": self.disconnect_storm,
            "hostile-tenant": self.hostile_tenant,
        }

    async def run(self, kinds: list[str], until: float, interval_s: float, every_kind: bool, t0: float,
                  say: Callable[[str], None]) -> None:  # fmt: skip
        """Events back to back, one started every `interval_s` at most, until `until` (loop time) and, with
        `every_kind`, until each kind ran once."""
        loop = asyncio.get_running_loop()
        n = 0
        while loop.time() < until or (every_kind and n < len(kinds)):
            kind = kinds[n % len(kinds)]
            n += 1
            start = loop.time()
            try:
                did, ok = await self.actions[kind](), True
            except Exception as exc:  # a process that would not start again, a check that could not run
                did, ok = f"FAILED: {type(exc).__name__}: {exc}", False
                self.load.tally.checks_failed.append(f"{kind} at {start - t0:.0f} s: {did}")
            event = Event(start - t0, kind, loop.time() - start, did, ok)
            self.events.append(event)
            say(f"{event.at_s:7.1f} s  {kind:<16} {event.took_s:5.1f} s  {did}")
            next_start = start + interval_s
            while loop.time() < next_start and (loop.time() < until or (every_kind and n < len(kinds))):
                await asyncio.sleep(min(0.2, next_start - loop.time()))

    def _replica(self, kind: str) -> Replica:
        """Replicas take turns per kind."""
        self.counts[kind] += 1
        return self.replicas[self.counts[kind] % len(self.replicas)]

    # -- processes ---------------------------------------------------------------------------------------
    async def worker_kill(self) -> str:
        replica = self._replica("worker")
        connected, lost = replica.cp.seen["connected"], replica.cp.seen["lost"]
        await replica.restart_worker()
        # A request through this replica: its next step finds the worker gone, if it had not already.
        n = self.counts["worker probe"] = self.counts["worker probe"] + 1
        prompt = self.load.prompts[n % len(self.load.prompts)]
        index = self.replicas.index(replica)
        done = await carry(self.load, prompt, key=f"{self.load.run}-wprobe-{n}", prefer=index, what="worker probe")
        await replica.reconnected(connected)
        requeued = re.search(r"(\d+) sequences requeued", replica.cp.last.get("lost", ""))
        found = f"{requeued.group(1)} sequences requeued" if replica.cp.seen["lost"] > lost and requeued else "?"
        return (f"{replica.name}: kill -9 worker, back on :{replica.worker_port}; its control plane lost it ({found}) "
                f"and reconnected; a request through it {'completed' if done else 'FAILED'}")  # fmt: skip

    async def replica_kill(self) -> str:
        replica = self._replica("replica")
        moved = await replica.restart_control_plane()
        return f"{replica.name}: kill -9 control plane, a new one on its worker ({moved})"

    # -- the store ---------------------------------------------------------------------------------------
    async def redis_restart(self, persisted: bool) -> str:
        load = self.load
        if persisted:
            await self.redis.arm_persistence()
        n = self.counts["probe"] = self.counts["probe"] + 1
        prompt, key = self.load.prompts[n % len(self.load.prompts)], f"{load.run}-probe-{n}"
        before = await carry(load, prompt, key=key, prefer=n, what=f"probe {n}")
        for _ in range(50):  # the record turns SUCCESS just after the last token is sent
            again = await carry(load, prompt, key=key, prefer=n, what=f"probe {n} settling")
            if again is None or again.outcome == "replayed":
                break
        if before is None or again is None:
            raise RuntimeError("the probe request failed before the restart")
        claimed = sum(r.cp.seen["claimed again"] for r in self.replicas)
        await self.redis.kill()
        await asyncio.sleep(0.5)  # callers see the store gone, as in a real restart
        await self.redis.start(persistent=persisted, keep_data=persisted)
        after = await carry(load, prompt, key=key, prefer=n, what=f"probe {n} after the restart")
        outcome = after.outcome if after is not None else "failed"
        if persisted and outcome != "replayed":
            load.tally.checks_failed.append(f"probe key {key} was {outcome} after an AOF restart, not replayed")
        await asyncio.sleep(1.0)  # the journal's next flush finds what the store lost
        reclaimed = sum(r.cp.seen["claimed again"] for r in self.replicas) - claimed
        kept = "from its AOF" if persisted else "empty (nothing persisted)"
        return (f"kill -9 Redis, back {kept}; a key that had succeeded is {outcome} after it; "
                f"{reclaimed} running requests claimed again by the journal")  # fmt: skip

    # -- callers -----------------------------------------------------------------------------------------
    async def disconnect_storm(self) -> str:
        load, rng, n = self.load, self.rng, self.sizes.storm
        live = load.live()
        token = load.tokens["good"]
        # Their own channels: closing them drops every stream at once, as a client crash or a network cut.
        keyed = [AsyncCoalesceClient(a, token) for a in live]  # the client keys each request itself
        keyless = [AsyncCoalesceClient(a, token, retry=NO_RETRY) for a in live]
        opened: list[Dropped] = []

        async def open_one(i: int) -> None:
            prompt, where, has_key = rng.choice(load.prompts), i % len(live), i % 2 == 1
            client = (keyed if has_key else keyless)[where]
            dedup = "auto" if has_key else self.sizes.storm_dedup
            cut = rng.randint(1, max(1, prompt.max_tokens // 2))
            dropped = Dropped(prompt, where, has_key)
            try:
                gen = client.generate(prompt.text, stream=True, max_tokens=prompt.max_tokens, dedup=dedup, **GREEDY)  # type: ignore[arg-type]
                async for chunk in gen:
                    dropped.tokens += chunk.token_ids
                    dropped.request_id, dropped.finish = chunk.request_id or dropped.request_id, chunk.finish_reason
                    dropped.outcome = dropped.outcome or chunk.dedup_outcome
                    if len(dropped.tokens) >= cut:
                        break
            except CoalesceError as err:
                load.tally.error("good", err, f"storm stream {i}")
                return
            opened.append(dropped)

        await asyncio.wait_for(asyncio.gather(*(open_one(i) for i in range(n))), 120)
        for client in keyed + keyless:
            await client.close()  # the drop: RST_STREAM on every open call, no Cancel
        exact = 0
        for d in rng.sample(opened, len(opened) // 2):
            if d.finish is not None:  # ended before the cut: nothing to resume, check it as it is
                exact += load.tally.check("good", d.prompt, d.tokens, d.finish, "storm stream")
                continue
            what = f"storm resume ({'keyed' if d.has_key else 'keyless'}, {d.outcome} on {live[d.where]})"
            done = await carry(load, d.prompt, key="", prefer=d.where + 1, what=what, request_id=d.request_id,
                               tokens=d.tokens)  # fmt: skip
            exact += done is not None and tuple(done.tokens) == d.prompt.reference
        dedup = self.sizes.storm_dedup
        return (f"{len(opened)} streams on {len(live)} replicas dropped mid-way (half keyless, dedup {dedup}); "
                f"{len(opened) // 2} resumed on the other replica: {exact} exact")  # fmt: skip

    async def hostile_tenant(self) -> str:
        load, sizes = self.load, self.sizes
        replica = self._replica("hostile")
        address, token = replica.address, load.tokens["hostile"]
        client = AsyncCoalesceClient(address, token, retry=NO_RETRY)
        try:
            prompt = load.prompts[0]
            first = await client.generate(prompt.text, max_tokens=prompt.max_tokens, **GREEDY).result()  # type: ignore[arg-type]
            load.tally.check("hostile", prompt, first.token_ids, first.finish_reason, "hostile request")
            good_before = load.tally.served["good"]
            flood: list[str | None] = []

            async def flood_all() -> None:
                flood.extend(await asyncio.gather(*(self._flood_one(client, i) for i in range(sizes.flood))))

            held = await self._unread_session(replica, address, token, first.request_id, flood_all())
        finally:
            await client.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while load.tally.served["good"] == good_before and loop.time() < deadline:
            await asyncio.sleep(0.2)
        good = load.tally.served["good"] - good_before
        if not good:
            load.tally.checks_failed.append("the good tenant completed nothing while the hostile tenant ran")
        refused = Counter(r for r in flood if r is not None)
        return (f"on {replica.name}: {held}; meanwhile a flood of {sizes.flood} distinct requests: "
                f"{flood.count(None)} served, refused {dict(refused) or 'none'}; the good tenant completed {good} "
                "requests meanwhile")  # fmt: skip

    async def _flood_one(self, client: AsyncCoalesceClient, i: int) -> str | None:
        """One request of the flood (distinct computations: dedup off): None when served and checked, else the
        reason it was refused."""
        prompt = self.load.prompts[i % len(self.load.prompts)]
        try:
            done = await client.generate(prompt.text, max_tokens=prompt.max_tokens, dedup="off", **GREEDY).result()  # type: ignore[arg-type]
        except CoalesceError as err:
            self.load.tally.error("hostile", err, f"flood {i}")
            return error_name(err)
        self.load.tally.check("hostile", prompt, done.token_ids, done.finish_reason, f"flood {i}")
        return None

    async def _unread_session(self, replica: Replica, address: str, token: str, request_id: str,
                              meanwhile: Awaitable[None]) -> str:  # fmt: skip
        """Send `resumes` Resumes of a finished request on one Session and read nothing while `meanwhile` runs
        and hold_s passes; then read it all: each Resume is answered or refused (STREAM_LIMIT)."""
        sizes = self.sizes

        async def requests() -> AsyncIterator[inference_pb2.SessionRequest]:
            for i in range(sizes.resumes):
                yield inference_pb2.SessionRequest(
                    stream_id=f"r{i}", resume=inference_pb2.SessionResume(request_id=request_id)
                )

        pid = replica.cp.pid or 0
        before = rss_kib(pid)
        refusals: Counter[str] = Counter()
        answered = 0
        async with grpc.aio.insecure_channel(address) as channel:
            call = inference_pb2_grpc.InferenceServiceStub(channel).Session(
                requests(), metadata=(("authorization", f"Bearer {token}"),)
            )
            await asyncio.gather(asyncio.sleep(sizes.hold_s), meanwhile)
            grown = (rss_kib(pid) - before) / 1024
            async for resp in call:
                if resp.HasField("error"):
                    err = session_error(resp.error)
                    refusals[error_name(err)] += 1
                    self.load.tally.error("hostile", err, f"hostile session {resp.stream_id}")
                elif resp.chunk.finish_reason:
                    answered += 1
        if answered + sum(refusals.values()) != sizes.resumes:
            self.load.tally.checks_failed.append(
                f"hostile session: {sizes.resumes} resumes, {answered} answered, {sum(refusals.values())} refused"
            )
        return (f"a Session of {sizes.resumes} Resumes held unread (control plane RSS {grown:+.0f} MiB), then "
                f"read: {answered} answered, refused {dict(refusals) or 'none'}")  # fmt: skip
