"""Several gateways, one fair queue: the policy's shared state in Redis.

Every ``sfq serve`` (or embedder's :class:`~sfq.dispatch.PolicyDispatcher`) started with the
same policy and the same Redis behaves as one gateway (``docs/API.md``, "Several gateways,
one queue"). Each keeps its own waiting requests and its engine orders them; a start the
engine decides becomes a *candidate*, and **one gateway, the fleet's decider, runs the
engine's own queues** (:class:`~sfq.state._local.Alone`, the whole policy) over stand-ins of
every gateway's candidates and grants them (docs/design.md §5a, §5a.1):

* a gateway's round trip (:data:`~sfq.state._lua.OFFER`) hands on its new candidates, new
  prices, withdrawals, the corrections of its running attempts' charges (a stream's delivered
  tokens, a settlement, a refund: :meth:`RedisState.charged`) and its releases, as events for
  the decider, and takes the grants the decider made for it; a candidate that finds nothing
  waiting in its pool and room in every limit starts at once, as one engine starts an
  uncontended request;
* the decider's round trip (:data:`~sfq.state._lua.DECIDE`) writes its grants (the leases:
  one per slot held, a member of a sorted set scored by its expiry in Redis's own time,
  renewed by its holder at least three times per ``lease_seconds``) and takes the events;
  its queues decide the next grants as one engine pops: strict classes, start tags (a tree of
  them under nested shares), slots, buckets, the busy period, the refund floors;
* the role is a Redis key that expires unless renewed: a gateway that finds none takes it,
  and a new decider starts from the candidates and running attempts Redis holds.

A grant reaches its gateway in a pub/sub message (a lost one by its next round trip, within
:data:`GRANT_POLL`). A gateway that dies stops renewing: its leases and candidates expire
within ``lease_seconds``. Every Redis call has a timeout.

While Redis cannot be reached the gateway is *degraded* (``state.on_loss: local``, the
default): it goes on alone, admitting, ordering and granting its own requests within its slice
of every global limit and budget (:mod:`sfq.state._local`: the live gateways' slices add up to
each limit), and a background probe brings Redis back; then the gateway puts back in Redis what
it holds (slots, waiting places, reservations) and its candidates rejoin the shared order,
meters level. With ``on_loss: refuse`` it is *unavailable* instead: new requests are refused
(503, ``state_unavailable``), running ones finish, waiting ones keep waiting within their
limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..errors import PolicyError, Refused
from ..policy.classify import Flow, unknown_org
from ..policy.config import OrgSpec, Policy, StateSpec
from ..cost import CostEstimator
from ..engine.pool import PolicyQueue, Request, guessed
from ..policy.spend import Hold
from ..policy.limits import TokenBucket
from . import _lua
from ._local import Alone, Slices, shares_table
from .base import SharedState, Ticket

__all__ = ["RedisState", "StateUnavailable", "policy_hash"]

log = logging.getLogger("sfq.state")

#: seconds between a waiting candidate's gateway's looks for its grant when no message comes
#: (the decider publishes each grant; this bounds a lost message, or a decider that died)
GRANT_POLL = 0.5
#: round trips in flight at once per pool (a new candidate need not wait for a release's)
MAX_CALLS = 2
#: seconds the decider's role lasts unless it renews it (each of its round trips does; at most
#: ``lease_seconds``): a decider that dies is replaced that much later, by the next gateway
#: that finds none
LEAD_TTL = 1.5
#: seconds between the decider's round trips when nothing wakes it (it renews its role, and
#: looks again at what a bucket or a dead gateway's expiry frees)
LEAD_POLL = 0.25
#: seconds between the decider's looks at which candidates and attempts are still alive
LIVE_EVERY = 1.0
#: seconds between probes while Redis cannot be reached
PROBE = 0.25
#: seconds a correction of a meter (a stream's delivered tokens) waits for a round trip to ride on
ADJUST_DELAY = 0.5
#: seconds a release waits for company (the next candidate of the same client, usually) before
#: its own round trip
RELEASE_DELAY = 0.002
#: seconds at most a new candidate waits for company (this gateway's next release in its pool,
#: usually) when it could not start at once anyway (candidates wait in its pool, as the last
#: round trip or message said) and its flow has one waiting at the decider from this gateway
#: already (a strict class's, and one with a deadline, never wait)
CANDIDATE_DELAY = 0.025
#: seconds for which a count of a pool's waiting candidates (a round trip's, a message's) holds
FULL_FRESH = 0.5
#: seconds a gateway back from going on alone waits, granting nothing, for the others it shared
#: the slices with to be back too (each puts back what it holds before it says so)
REJOIN_WAIT = 2.0
#: seconds between its looks meanwhile (Redis answers: a look is cheap, and every gateway waits)
REJOIN_POLL = 0.05
#: seconds for which the slots held over every gateway, as a round trip saw them, say what is
#: left of a limit should Redis be lost (older: nothing is taken to be left)
SEEN_FRESH = 2.0


#: seconds: an unbounded wait for an org's token, as ``ADMIT`` takes it (JSON has no infinity)
_FOREVER = 1e12

#: why a request that waited was refused after all (another org's admission took its place)
_EVICTED = ("the request's waiting place went to another org's request: its class's queue was full (max_queue_length, "
            "all gateways together) and this org held the most places")


def _list(x: Any) -> list[Any]:
    """A list from Lua's cjson, which writes an empty one as ``{}``."""
    return x if isinstance(x, list) else []


class StateUnavailable(Exception):
    """Redis could not be reached (or answered an error) within the call's timeout."""


def _leads_of(text: Any) -> dict[str, Any]:
    """The decider's leads from their JSON (``P leads``): ``{}`` when absent or not an object."""
    try:
        leads = json.loads(text or "{}")
    except (ValueError, TypeError):
        return {}
    return leads if isinstance(leads, dict) else {}


def policy_hash(policy: Policy) -> str:
    """A hash of everything the policy decides (not the file's path)."""
    return hashlib.sha256(repr(replace(policy, source="")).encode()).hexdigest()


class _Attempt:
    """One attempt's candidacy, then its grant (the lease keys it holds)."""

    __slots__ = ("member", "pool", "keys", "granted", "payload", "request", "fut", "inflight", "registered", "flow",
                 "known", "local", "at")

    def __init__(self, member: str, pool: str) -> None:
        self.member = member
        self.pool = pool
        self.keys: list[str] = []
        self.granted = False
        self.payload: dict[str, Any] = {}
        self.request: Request | None = None
        self.fut: asyncio.Future[str] | None = None
        self.inflight = False  # in a round trip now
        self.registered = False  # a candidate in Redis (it has a start tag)
        self.known = False  # Redis has its details: later calls send only its name
        self.flow = ""
        self.local = False  # granted by this gateway alone, while Redis was lost
        self.at = 0.0  # when it became a candidate (this gateway's clock)


class RedisState(SharedState):
    """The shared state of ``policy`` in Redis (``spec``: the policy's ``state`` section).

    ``clock``: the dispatcher's clock (only for the local waits' bounds; every expiry is
    Redis's time); ``timeout``: seconds for each Redis call; ``gateway_id``: this process's
    name in Redis (default: a fresh random one, so a restarted gateway never takes over
    what the dead one held); ``client``: a ``redis.asyncio.Redis`` (default: from the URL).
    """

    shared = True

    def __init__(self, spec: StateSpec, policy: Policy, *, clock: Callable[[], float] = time.monotonic,
                 timeout: float = 0.5, gateway_id: str | None = None, client: Any = None) -> None:
        if not isinstance(spec, StateSpec):
            raise TypeError(f"spec must be an sfq.policy.StateSpec, got {spec!r}")
        if spec.redis is None:
            raise ValueError("state.redis: a shared state needs a redis:// URL (state.file is one gateway's spend)")
        self.url: str = spec.redis
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.spec = spec
        self.policy = policy
        self.clock = clock
        self.timeout = float(timeout)
        self.lease = float(spec.lease_seconds)
        self.prefix = spec.prefix
        self.gateway_id = gateway_id or os.urandom(6).hex()
        self.hash = policy_hash(policy)
        self._client = client
        self._scripts: dict[str, Any] = {}
        self._available = False
        self._reason: str | None = "not connected to Redis yet"
        self._fatal: str | None = None
        self._att: dict[int, _Attempt] = {}
        self._pending: dict[str, dict[str, _Attempt]] = {}  # pool -> member -> waiting for its grant
        self._calls: dict[str, int] = {}  # pool -> round trips in flight
        self._timers: dict[str, asyncio.TimerHandle] = {}
        #: when the last message on ``P wake`` came, and when the subscription last began: a
        #: look for grants by round trip is needed only when messages may have been lost
        self._heard_at = -math.inf
        self._subscribed_at = math.inf
        self._dirty: dict[str, bool] = {}
        self._releases: dict[str, list[dict[str, Any]]] = {}  # pool -> releases for the driver's next call
        self._withdrawn: dict[str, list[str]] = {}  # pool -> candidates that left, for the next call
        #: pool -> member -> cost units: the engine's corrections of granted attempts' charges,
        #: summed per attempt until the pool's next round trip carries them
        self._adj: dict[str, dict[str, float]] = {}
        #: the fleet's decider (docs/design.md §5a.1), when this gateway is it: the engine's
        #: queues over stand-ins of every gateway's candidates; its decisions not yet in Redis
        self._leading = False
        self._lead: Alone | None = None
        self._decided: list[tuple[str, str, str]] = []  # (member, backend, pool)
        #: the decider's own gateway's candidates, prices, withdrawals and releases: applied to
        #: its queues at once, to Redis with its next round trip (``DECIDE``, not ``OFFER``);
        #: pool -> {"c": [candidate], "p": [[m, cost, guess]], "w": [m], "rel": [release]}
        self._own: dict[str, dict[str, list[Any]]] = {}
        self._own_att: list[_Attempt] = []  # the candidates in ``_own``, known once it is in Redis
        self._own_adj: dict[str, dict[str, float]] = {}  # the corrections in it (back to _adj if it is not)
        self._decide_at = -math.inf  # the decider's last round trip
        #: (event order, when) of a grant Redis found no room for: the decider grants nothing
        #: more until it applied a newer event, or :data:`LEAD_POLL` later
        self._hold: tuple[int, float] | None = None
        self._wake_timer: asyncio.TimerHandle | None = None  # the decider's look at a bucket's refill
        self._lead_evt: asyncio.Event | None = None
        self._live_at = -math.inf
        self._applied_q = 0  # the order number of the last event the decider applied
        #: the decider's tables of the gateways' shares (version, {gateway: share}) seen last
        self._tables: list[tuple[Any, dict[str, float]]] = []
        self._table_at = -math.inf  # when this gateway, deciding, last made one
        self._table_out: str | None = None  # made, to go with its next round trip
        self._leads_out: str | None = None  # its queues' meters' leads (Alone.leads), with the table
        #: the decider's leads as this gateway last had them (``P leads``, with a renewal; its own
        #: queues' when it decided): where its meters start should Redis be lost; and their version
        self._leads_in: dict[str, Any] = {}
        self._leads_v = ""
        self._leads_sent: dict[str, Any] = {}  # the leads its last table went with (``_leads_out``)
        self.decisions = 0  # grants this gateway decided as the decider
        self._ttl = min(LEAD_TTL, self.lease)  # (a dead decider is replaced no later than its leases expire)
        #: the delivered-service modes: a flow's running work keeps its meter (a flow lease)
        self._flow_work = policy.cost.charge != "seed"
        #: called with a request's id when another gateway's admission took its waiting place
        #: (the org holding the most places loses one): the driver ends it (``queue_full``)
        self.on_evicted: Callable[[int], None] | None = None
        #: the engine's estimator (set by the dispatcher): whether a charge is a guess (``guessed``)
        self.estimator: CostEstimator | None = None
        self._queued: dict[int, tuple[str, str]] = {}  # request id -> (queue key, member)
        self._retrying: dict[int, tuple[str, str]] = {}  # request id -> (outstanding retries key, member)
        #: (live users key, user member) -> this gateway's live requests of that user (max_users)
        self._users: dict[tuple[str, str], int] = {}
        self._user_req: dict[int, tuple[str, str]] = {}  # request id -> its user's (key, member)
        self._spending: dict[str, tuple[list[str], str]] = {}  # member -> (spend keys, member): reservations held
        self._unsettled: list[dict[str, Any]] = []  # settlements Redis did not take yet (sent again on renewal)
        self._budgeted = policy.retry.max_attempts > 1 and policy.retry.budget_per_flow_percent < 100
        self._tickets = itertools.count(1)
        self._up: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._probe: asyncio.Task[Any] | None = None
        self._closed = False
        self._refusing = False
        self.round_trips = 0
        self.trips_by: dict[str, int] = {}  # script -> round trips
        #: what each OFFER carried (``c`` new candidates, ``p`` prices, ``w`` withdrawals, ``a``
        #: corrections, ``rel`` releases, joined by ``+``; ``look``: only a look for grants)
        self.offers_by: dict[str, int] = {}
        #: the live gateways (ids, sorted) as Redis last named them: the slices kept without it
        self._gateways: list[str] = []
        #: degraded (Redis lost, ``on_loss: local``): each pool's local order, and the local
        #: buckets (pool rpm / tpm, org rpm) and budget slices, made when first needed
        self._alone: Alone | None = None
        self._alone_first = False  # it holds the first lease_seconds' parts (then the slices)
        self._local_buckets: dict[str, TokenBucket] = {}
        self._budget_left: dict[str, float] = {}  # spend key -> unspent and unreserved, last seen
        self._budget_slice: dict[str, float] = {}  # spend key -> what this gateway may still reserve alone
        self._local_holds: dict[str, tuple[list[str], float]] = {}  # member -> (spend keys, amount) reserved alone
        self.degraded_since: float | None = None
        self._rejoining = False  # putting back what was granted alone: nothing more is, until Redis grants
        #: candidates per flow registered in Redis at once (the rest wait here, in order)
        self._cap = {name: pool.limits.max_in_flight or 8 for name, pool in policy.pools.items()}
        self._seen_keys_of(policy)
        #: lease key -> the slots held over every gateway as this gateway last saw them (its
        #: round trips): what was left of each limit when Redis was lost
        self._seen: dict[str, tuple[float, int]] = {}  # lease key -> (when, count)
        self._waiting: dict[str, tuple[float, int]] = {}  # pool -> (when, candidates waiting in it)
        self._cand_prefix = f"{self.prefix}cand:"
        #: degraded: lease key -> the slots this gateway held when Redis was lost
        self._held_at_loss: dict[str, int] = {}

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect and check that the gateways sharing the prefix run the same policy
        (``PolicyError`` when they do not). Redis down at start is not an error: the state
        stays unavailable and a background probe connects when it can."""
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(
                self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                retry_on_timeout=False, health_check_interval=0)
        for name in ("ADMIT", "OFFER", "DECIDE", "WITHDRAW", "RENEW", "RETRY", "HELLO", "GATEWAYS",
                     "SPEND_RESERVE", "SPEND_SETTLE"):
            self._scripts[name] = self._client.register_script(getattr(_lua, name))
        self._up = asyncio.get_running_loop().create_future()
        try:
            await self._hello()
        except StateUnavailable as exc:
            log.warning("Redis %s cannot be reached (%s); refusing requests until it can (no slice of the limits "
                        "is known before it was seen)", self.spec.redis, exc)
            self._go_down(f"Redis {self.spec.redis} cannot be reached: {exc}")
        if self._fatal is not None:
            raise PolicyError("state", self._fatal)
        self._lead_evt = asyncio.Event()
        self._loops = [asyncio.create_task(self._renew_loop()), asyncio.create_task(self._listen_loop()),
                       asyncio.create_task(self._lead_loop())]

    def refuse_waiting(self) -> None:
        self._refusing = True
        for pending in self._pending.values():
            for a in list(pending.values()):
                if a.fut is not None and not a.fut.done():
                    a.fut.set_exception(Refused("closed", "the gateway closed before the shared state granted "
                                                          "this request's start"))
        if self._up is not None and not self._up.done():
            self._up.set_result(None)

    async def close(self) -> None:
        if self._closed:
            return
        self.refuse_waiting()
        if self._connected:  # give back what ended last, now, and the decider's role
            self._lead = None
            self._requeue_own(kick=False)  # (the decider's own, not in Redis yet)
            pools = set(self._releases) | set(self._adj) | set(self._withdrawn) | {next(iter(self.policy.pools))}
            for pool in pools:
                rel, adj, w = self._releases.get(pool, []), self._take_adj(pool), self._withdrawn.get(pool, [])
                with contextlib.suppress(StateUnavailable):
                    await self._call_json("OFFER", {**self._pool_args(pool), "a": adj, "rel": rel[:], "w": w[:],
                                                    "resign": self._leading})
                rel.clear()
                w.clear()
        self._leading = False
        self._lead = None
        self._closed = True
        for h in self._timers.values():
            h.cancel()
        loops = self._loops + ([self._probe] if self._probe else [])
        for t in loops:
            t.cancel()
        for t in loops:
            with contextlib.suppress(BaseException):
                await t
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.timeout * 2)
        if self._client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._client.aclose(), self.timeout)

    async def abandon(self) -> None:
        """Stop renewing and talking to Redis at once, giving nothing back (what a gateway that
        dies does; for tests)."""
        self._closed = True
        for h in self._timers.values():
            h.cancel()
        for t in self._loops + ([self._probe] if self._probe else []) + list(self._tasks):
            t.cancel()

    @property
    def _connected(self) -> bool:
        """Redis answers, and the gateways of the prefix run this policy."""
        return self._available and self._fatal is None

    @property
    def degraded(self) -> bool:
        """Redis cannot be reached and this gateway goes on alone, within its slices
        (``on_loss: local``; the slices need the live gateways, which Redis named at least once)."""
        return (not self._available and self._fatal is None and not self._closed and self.spec.on_loss == "local"
                and self.gateway_id in self._gateways)

    @property
    def available(self) -> bool:
        return self._connected or self.degraded

    @property
    def reason(self) -> str | None:
        return self._fatal or (None if self._available else self._reason)

    def _slices(self) -> Slices:
        """This gateway's slices while Redis is lost: by the decider's last two tables of the
        gateways' shares (the smaller part of the two: a table changes at most every
        ``lease_seconds / 2``, so every live gateway saw the one before the last, and the parts
        add up to at most each limit), else equal parts by rank."""
        return Slices(self._gateways.index(self.gateway_id), len(self._gateways), self.gateway_id,
                      [t for _, t in self._tables] if len(self._tables) == 2 else [])

    # ------------------------------------------------------------ Redis calls
    async def _call(self, name: str, payload: dict[str, Any]) -> list[Any]:
        res = await self._raw(name, payload)
        return [x.decode() if isinstance(x, bytes) else x for x in res]

    async def _raw(self, name: str, payload: dict[str, Any]) -> Any:
        if self._client is None:
            raise StateUnavailable("not started")
        self.round_trips += 1
        self.trips_by[name] = self.trips_by.get(name, 0) + 1
        try:
            return await asyncio.wait_for(
                self._scripts[name](args=[self.prefix, json.dumps(payload, separators=(",", ":"))]),
                self.timeout)
        except asyncio.TimeoutError:
            self._go_down(f"Redis {self.spec.redis} did not answer within {self.timeout:g} s")
            raise StateUnavailable(f"no answer within {self.timeout:g} s") from None
        except (OSError, Exception) as exc:
            import redis.exceptions as rexc

            if isinstance(exc, (OSError, rexc.ConnectionError, rexc.TimeoutError)):
                self._go_down(f"Redis {self.spec.redis} cannot be reached: {exc}")
                raise StateUnavailable(str(exc)) from None
            if isinstance(exc, rexc.RedisError):
                self._go_down(f"Redis {self.spec.redis} answered an error: {exc}")
                raise StateUnavailable(str(exc)) from None
            raise

    async def _call_json(self, name: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A script that answers one JSON object (Lua's cjson writes an empty list as ``{}``:
        :func:`_list` reads either)."""
        res = await self._raw(name, payload)
        out: dict[str, Any] = json.loads(res)
        return out

    async def _hello(self, force: bool = False, up: bool = True) -> None:
        res = await self._call("HELLO", {"lease": self.lease, "hash": self.hash, "force": force})
        if res[0] != 1:
            self._fatal = self._mismatch(str(res[1]))
            self._available = False
            return
        self._fatal = None
        if up:
            self._gateways = await self._alive()
            self._go_up()

    async def _alive(self) -> list[str]:
        """This gateway is alive: the live ones, as Redis names them (sorted ids); and the
        decider's table of their shares, kept with the one before it (:meth:`_slices`)."""
        return self._gateways_of(await self._call_json("GATEWAYS", {"gw": self.gateway_id, "lease": self.lease,
                                                                   "lv": self._leads_v}))

    def _gateways_of(self, res: dict[str, Any]) -> list[str]:
        """``GATEWAYS``' answer (also ``RENEW``'s): the live ids, sorted; the table kept, and the
        decider's leads when newer than those kept."""
        table = res.get("table") or ""
        if table:
            try:
                t = json.loads(table)
                v, shares = t["v"], {str(g): float(x) for g, x in t["s"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                v, shares = None, {}
            if v is not None and (not self._tables or self._tables[-1][0] != v):
                self._tables = (self._tables + [(v, shares)])[-2:]
        lv = res.get("lv")
        if isinstance(lv, str) and lv != self._leads_v:
            self._leads_v, self._leads_in = lv, _leads_of(res.get("leads"))
        return sorted(str(g) for g in _list(res.get("ids")))

    def reloaded(self, policy: Policy) -> None:
        """A reload put ``policy`` in force: its limits from now on, and its hash for the prefix
        (the other gateways refuse requests, saying why, until they are reloaded too)."""
        self.policy = policy
        self.hash = policy_hash(policy)
        self._cap = {name: pool.limits.max_in_flight or 8 for name, pool in policy.pools.items()}
        self._seen_keys_of(policy)
        self._lose_lead()  # the decider starts again, on the new policy, from what Redis holds
        self._fatal = None
        self._spawn(self._hello_forced())

    async def _hello_forced(self) -> None:
        with contextlib.suppress(StateUnavailable):
            await self._hello(force=True)

    def _mismatch(self, cur: str) -> str:
        return (f"the gateways sharing Redis prefix {self.prefix!r} at {self.spec.redis} run a different policy "
                f"(hash in force {cur[:12]}, this file's {self.hash[:12]}): start every gateway of a prefix "
                "with the same policy file")

    def _go_down(self, reason: str) -> None:
        if self._closed:
            return
        was = self._available
        self._available = False
        self._reason = reason
        self._leading = False  # (another gateway may decide meanwhile: this one starts again, if at all)
        if self._lead is not None:  # it decided: its own queues' meters are the freshest
            self._leads_in = self._lead.leads()
        self._lose_lead()
        for pending in self._pending.values():  # Redis may come back empty: each is sent whole again
            for a in pending.values():
                a.known = False
        if was:
            if self.degraded:
                self.degraded_since = self.clock()
                self._held_at_loss = self._holding()
                s = self._slices()
                log.error("shared state unavailable: %s; going on alone, gateway %d of %d (degraded)", reason,
                          s.rank + 1, s.n)
                for pool in list(self._pending):  # the candidates waiting for Redis: this gateway's order now
                    self._kick(pool)
            else:
                log.error("shared state unavailable: %s", reason)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    def _go_up(self) -> None:
        if not self._available:
            log.info("shared state available (Redis %s)%s", self.spec.redis,
                     "; rejoining the shared order" if self.degraded_since is not None else "")
        self._available = True
        self._reason = None
        self.degraded_since = None
        # the local order's meters and slices are this gateway's alone: the shared ledger's again
        self._alone = None
        self._local_buckets.clear()
        self._budget_slice.clear()
        if self._up is not None and not self._up.done():
            self._up.set_result(None)
        self._up = asyncio.get_running_loop().create_future()
        for pool in list(self._pending):
            self._kick(pool)

    async def _probe_loop(self) -> None:
        back_at: float | None = None
        while not self._closed and not self._available and self._fatal is None:
            await asyncio.sleep(PROBE if back_at is None else REJOIN_POLL)
            try:
                await self._hello(up=False)
                if self._fatal is not None:
                    continue
                # Redis answers. A gateway that went on alone stops granting alone, puts back
                # what it holds (slots granted alone too: Redis may have restarted empty), and
                # only then names itself live; it rejoins when every gateway it shared the
                # slices with is named live (each has put back what it holds and grants nothing
                # alone), or after REJOIN_WAIT (one that does not come back is dead, and what
                # it held died with it)
                alone = self.degraded
                self._rejoining = True
                await self._renew(add=True, alive=False)
                live = await self._alive()
                now = self.clock()
                back_at = now if back_at is None else back_at
                if alone and any(g not in live for g in self._gateways) and now - back_at < REJOIN_WAIT:
                    continue
                self._rejoining = False
                if self._fatal is None:
                    self._gateways = live
                    self._go_up()
            except StateUnavailable:  # (gone again: alone again, granting)
                back_at = None
                if self._rejoining:
                    self._rejoining = False
                    for pool in list(self._pending):
                        self._kick(pool)
        self._rejoining = False

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _wakeup(self, text: str) -> None:
        """A message on ``P wake``: ``e`` (events for the decider), ``g:<gateway>`` (grants for
        that gateway, taken by its next round trip)."""
        if text.startswith("n\n"):  # the slots held over every gateway, now
            try:
                counts = json.loads(text[2:])
            except ValueError:
                return
            at = self.clock()
            for key, c in _list(counts):
                key = str(key)
                if key.startswith(self._cand_prefix):
                    self._waiting[key[len(self._cand_prefix):]] = (at, int(c))
                else:
                    self._seen[key] = (at, int(c))
            return
        if text.startswith("e\n"):  # events for the decider, in order: it decides at once
            if not self._leading or self._lead_evt is None:
                return
            if self._lead is None:
                self._lead_evt.set()
                return
            try:
                evs = json.loads(text[2:])
            except ValueError:
                evs = []
            gap = self._take_events(self._lead, [e for e in _list(evs) if isinstance(e, dict)])
            self._decide_now(self._lead)
            if gap:  # (a message lost: the next round trip fetches what is missing)
                self._lead_evt.set()
        elif text.startswith("g:" + self.gateway_id + "\n"):  # the grants themselves: no round trip
            try:
                grants = json.loads(text[len(self.gateway_id) + 3:])
            except ValueError:
                grants = []
            for m, backend, keys in _list(grants):
                self._grant(str(m), str(backend), [str(k) for k in _list(keys)])

    # ------------------------------------------------------------ renewals and wake-ups
    def _held(self) -> list[list[str]]:
        p = self.prefix
        items: list[list[str]] = []
        for a in self._att.values():
            if a.granted:
                items.extend([k, a.member] for k in a.keys)
            elif a.registered and a.known:
                items.append([f"{p}cexp", a.member])
        items.extend([k, m] for k, m in self._queued.values())
        items.extend([k, m] for k, m in self._users)
        items.extend([k, m] for k, m in self._retrying.values())
        items.extend([f"{k}:res", m] for ks, m in self._spending.values() for k in ks)
        return items

    async def _renew(self, add: bool = False, alive: bool = True) -> None:
        while self._unsettled:  # settlements that failed while Redis was away
            await self._call("SPEND_SETTLE", self._unsettled[0])
            self._unsettled.pop(0)
        items = self._held()
        res = await self._call("RENEW", {"lease": self.lease, "hash": self.hash, "add": add, "items": items,
                                         "gw": self.gateway_id if alive else None, "lv": self._leads_v,
                                         "runs": self._runs() if add else []})
        if res[0] != 1:
            if self._fatal is None:
                self._fatal = self._mismatch(str(res[1]))
                log.error("refusing requests: %s", self._fatal)
            return
        if self._fatal is not None:  # the others were reloaded to this gateway's policy
            log.info("the gateways of prefix %r run the same policy again", self.prefix)
            self._fatal = None
        if alive and res[1]:
            try:
                self._gateways = self._gateways_of(json.loads(res[1]))
            except ValueError:
                pass
        missing = res[2:]
        if missing and not add:  # Redis lost them (a restart): put back those still held
            held = {(k, m) for k, m in self._held()}
            cexp = f"{self.prefix}cexp"
            lost = {items[int(i)][1] for i in missing if items[int(i)][0] == cexp}
            if lost:  # a candidate is sent whole again with its pool's next round trip
                for pool, pending in self._pending.items():
                    for a in pending.values():
                        if a.member in lost:
                            a.known = False
                    self._kick(pool)
            back = [items[int(i)] for i in missing if tuple(items[int(i)]) in held and items[int(i)][0] != cexp]
            if back:
                log.warning("Redis had lost %d of this gateway's leases; putting them back", len(back))
                await self._call("RENEW", {"lease": self.lease, "hash": self.hash, "add": True, "items": back,
                                           "runs": self._runs()})

    def _runs(self) -> list[list[str]]:
        """This gateway's running attempts, as the decider adopts them (``P run``)."""
        return [[a.member, json.dumps({"pool": a.pool, "flow": list(a.request.flow), "b": a.request.backend})]
                for a in self._att.values() if a.granted and a.request is not None and a.request.backend]

    async def _renew_loop(self) -> None:
        period = self.lease / 4.0  # at least three renewals per lease
        while not self._closed:
            await asyncio.sleep(period)
            if self._available:
                with contextlib.suppress(StateUnavailable):
                    await self._renew()

    async def _listen_loop(self) -> None:
        channel, evict = f"{self.prefix}wake", f"{self.prefix}evict"
        while not self._closed:
            ps = None
            try:
                if not self._available:
                    await asyncio.sleep(PROBE)
                    continue
                assert self._client is not None
                ps = self._client.pubsub()
                await asyncio.wait_for(ps.subscribe(channel, evict), self.timeout)
                self._subscribed_at = self.clock()
                while not self._closed:
                    m = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if m is not None and m.get("type") == "message":
                        self._heard_at = self.clock()
                        d, c = m.get("data"), m.get("channel")
                        text = d.decode() if isinstance(d, bytes) else str(d)
                        if (c.decode() if isinstance(c, bytes) else str(c)) == evict:
                            self._evicted(text)
                        else:
                            self._wakeup(text)
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis went away: the probe brings it back; resubscribe then
                self._subscribed_at = math.inf
                await asyncio.sleep(PROBE)
            finally:
                if ps is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(ps.aclose(), self.timeout)

    # ------------------------------------------------------------ admission
    def _org(self, name: str) -> OrgSpec:
        """The org of an admitted flow (the file's, or made from its template)."""
        org = self.policy.org(name)
        if org is None:  # (the engine admits only flows the policy allows)
            raise unknown_org(name)
        return org

    def _unavailable(self) -> Refused:
        return Refused("state_unavailable", f"the gateways' shared state cannot be used: {self.reason}")

    async def admit(self, flow: Flow, horizon: float | None = None) -> Ticket | None:
        if not self._connected:
            if self.degraded:
                return self._admit_alone(flow, horizon)
            raise self._unavailable()
        cls = self.policy.classes[flow.cls]
        org = self._org(flow.org)
        q = None
        member = f"{self.gateway_id}:t{next(self._tickets)}\t{flow.org}"
        if cls.max_queue_length is not None:
            q = [f"{self.prefix}queue:{flow.pool}:{flow.cls}", cls.max_queue_length]
        rate = None
        if org.requests_per_minute is not None:  # (-1: refused at once over it; else seconds it may wait)
            h = -1.0 if horizon is None else min(horizon, _FOREVER)
            rate = [f"{self.prefix}bucket:org:{flow.org}", org.requests_per_minute, org.requests_per_minute / 60.0, h]
        u = self._user_of(flow)
        if q is None and rate is None and u is None:
            return None
        try:
            res = await self._call("ADMIT", {"m": member, "o": flow.org, "lease": self.lease, "q": q, "org": rate,
                                             "u": None if u is None else list(u)})
        except StateUnavailable:
            raise self._unavailable() from None
        if res[0] == 1:
            if len(res) > 1 and res[1]:  # a place taken from the org holding the most
                self._evicted(str(res[1]))
            user = None if u is None else (u[0], u[1])
            self._user_live(user, 1)
            return Ticket(member, flow, q is not None, user, float(res[2]) if len(res) > 2 else 0.0)
        if res[1] == "too_many_users":
            assert u is not None
            where = f"team {flow.team!r} of org {flow.org!r}" if flow.team is not None else f"org {flow.org!r}"
            raise Refused("too_many_users", f"{where} already has {u[2]} users with requests waiting or running "
                                            "(max_users, all gateways together); this user's request is refused "
                                            "until one of them is done", retry_after=float(res[2]))
        if res[1] == "rate_limited":
            raise Refused("rate_limited", f"org {flow.org!r} is over its requests_per_minute "
                                          f"({org.requests_per_minute:g}, all gateways together)",
                          retry_after=float(res[2]))
        raise Refused("queue_full", f"class {flow.cls!r} already has {cls.max_queue_length} requests waiting in "
                                    f"pool {flow.pool!r} (max_queue_length, all gateways together), and org "
                                    f"{flow.org!r} holds the most of them",
                      retry_after=float(res[2]))

    def _user_of(self, flow: Flow) -> tuple[str, str, int] | None:
        """A nested flow's user's place among its team's (or org's) live users over every
        gateway: ``(key, member, max_users)``; ``None`` for a flow without a user."""
        if len(flow) <= 3 or flow.user is None:
            return None
        org = self._org(flow.org)
        most = org.teams[flow.team].max_users if flow.team is not None else org.max_users
        return (f"{self.prefix}users:{flow.org}\t{flow.team or ''}", f"{flow.user}\t{self.gateway_id}", int(most))

    def _user_live(self, user: tuple[str, str] | None, n: int) -> None:
        """This gateway's live requests of a user, counted: its place (a lease, renewed) is
        given back when the last one ends."""
        if user is None:
            return
        k = self._users.get(user, 0) + n
        if k > 0:
            self._users[user] = k
            return
        self._users.pop(user, None)
        if self._connected:
            self._spawn(self._withdraw(list(user)))

    def _admit_alone(self, flow: Flow, horizon: float | None = None) -> Ticket | None:
        """:meth:`admit` while Redis is lost: the org's rate, the class's waiting places and
        the team's live users within this gateway's slices of them."""
        cls = self.policy.classes[flow.cls]
        org = self._org(flow.org)
        sl = self._slices()
        u = self._user_of(flow)
        if u is not None and (u[0], u[1]) not in self._users:
            mine = sl.count(u[2])
            if sum(1 for k, _ in self._users if k == u[0]) >= mine:
                where = f"team {flow.team!r} of org {flow.org!r}" if flow.team is not None else f"org {flow.org!r}"
                raise Refused("too_many_users", f"{where} already has {mine} users with requests waiting or running "
                                                f"at this gateway, its part of max_users ({u[2]}) while the gateways' "
                                                "shared state cannot be reached", retry_after=1.0)
        q = None
        if cls.max_queue_length is not None:
            q = f"{self.prefix}queue:{flow.pool}:{flow.cls}"
            mine = sl.count(cls.max_queue_length)
            if sum(1 for k, _ in self._queued.values() if k == q) >= mine:
                raise Refused("queue_full", f"class {flow.cls!r} already has {mine} requests waiting in pool "
                                            f"{flow.pool!r} at this gateway, its part of max_queue_length "
                                            f"({cls.max_queue_length}) while the gateways' shared state cannot be "
                                            "reached", retry_after=1.0)
        wait = 0.0
        if org.requests_per_minute is not None:
            b = self._bucket(f"org:{flow.org}", org.requests_per_minute)
            now = self.clock()
            if not b.take(1, now):
                wait = max(b.wait(1, now), 0.001)
                if horizon is None or wait >= horizon:
                    raise Refused("rate_limited", f"org {flow.org!r} is over its requests_per_minute "
                                                  f"({org.requests_per_minute:g}, all gateways together; this "
                                                  "gateway's part while the shared state cannot be reached)",
                                  retry_after=wait)
                b.debit(1, now)  # on_limit: wait: its token, taken ahead
        user = None if u is None else (u[0], u[1])
        if q is None and user is None and not wait:
            return None
        self._user_live(user, 1)
        return Ticket(f"{self.gateway_id}:t{next(self._tickets)}\t{flow.org}", flow, q is not None, user, wait)

    def _bucket(self, name: str, per_minute: float) -> TokenBucket:
        """This gateway's part of a global bucket while Redis is lost (full when first needed)."""
        b = self._local_buckets.get(name)
        if b is None:
            b = self._local_buckets[name] = self._slices().bucket(per_minute, self.clock())
        return b

    def _evicted(self, member: str) -> None:
        """Another admission took the waiting place ``member`` (its org held the most): when it
        is this gateway's and its request has not started, that request ends as refused
        (``queue_full``). One that started meanwhile runs on (its place was freed anyway)."""
        if not member.startswith(self.gateway_id + ":"):
            return
        rid = next((i for i, (_, m) in self._queued.items() if m == member), None)
        if rid is None:
            return
        del self._queued[rid]
        a = self._att.get(rid)
        if a is not None and not a.granted:
            if a.fut is not None and not a.fut.done():
                a.fut.set_exception(Refused("queue_full", _EVICTED))
            return
        if a is None and self.on_evicted is not None:
            self.on_evicted(rid)

    def bind(self, ticket: Ticket | None, r: Request) -> None:
        if ticket is not None and ticket.queued:
            self._queued[r.id] = (f"{self.prefix}queue:{r.flow.pool}:{r.flow.cls}", ticket.member)
        if ticket is not None and ticket.user is not None:
            self._user_req[r.id] = ticket.user

    def drop(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            self._user_live(ticket.user, -1)
        if ticket is not None and ticket.queued and self._connected:
            self._spawn(self._withdraw([f"{self.prefix}queue:{ticket.flow.pool}:{ticket.flow.cls}", ticket.member]))

    # ------------------------------------------------------------ starts
    def _pool_args(self, pool: str) -> dict[str, Any]:
        lim = self.policy.pools[pool].limits
        return {"gw": self.gateway_id, "lease": self.lease, "ttl": self._ttl, "pool": pool,
                "pool_lim": -1 if lim.max_in_flight is None else lim.max_in_flight,
                # an uncontended candidate starts at once unless a token bucket (the decider's) applies,
                # or slots are kept back (limits.headroom: whether a flow may take one is the decider's)
                "fast": not lim.requests_per_minute and not lim.tokens_per_minute and not lim.headroom}

    def _seen_keys_of(self, policy: Policy) -> None:
        """The lease keys of each pool and its backends (what a round trip asks the counts of),
        made once per policy: ``_lease_keys`` per pool, ``_lease_keys_all`` for every pool; and
        ``_plim``, each pool's ``max_in_flight``."""
        p = self.prefix
        self._lease_keys = {name: [f"{p}lease:pool:{name}", *(f"{p}lease:backend:{b.name}" for b in pool.backends)]
                            for name, pool in policy.pools.items()}
        self._lease_keys_all = [k for keys in self._lease_keys.values() for k in keys]
        #: each pool's max_in_flight (-1: none), for DECIDE's look at what the leases count
        self._plim = {n: -1 if p.limits.max_in_flight is None else p.limits.max_in_flight for n, p in policy.pools.items()}

    def _candidate(self, r: Request, a: _Attempt, backends: Sequence[tuple[str, int]]) -> dict[str, Any]:
        pol = self.policy
        flow = r.flow
        cls = pol.classes[flow.cls]
        p = self.prefix
        groups: list[list[Any]] = []
        org = self._org(flow.org)
        if org.max_in_flight is not None:
            groups.append([f"{p}lease:org:{flow.org}", org.max_in_flight])
        if cls.max_in_flight is not None:
            groups.append([f"{p}lease:class:{flow.cls}", cls.max_in_flight])
        q = self._queued.get(r.id)
        return {"m": a.member, "pool": flow.pool, "flow": list(flow), "cost": r.cost, "tokens": r.tokens,
                "guess": self._flow_work and not cls.strict and self.estimator is not None
                and guessed(r, self.estimator),
                "strict": cls.strict, "backends": [n for n, _ in backends], "lims": [int(lm) for _, lm in backends],
                "groups": groups,
                "q": None if q is None else list(q),
                # seconds left to its deadline (EDF inside its flow at the decider: design.md §5d)
                "dl": None if r.deadline is None or r.drop_at == math.inf else max(0.0, r.drop_at - self.clock()),
                "first": (f"{p}rb:first:{flow.org}\t{flow.cls}\t{flow.pool}"
                          if self._budgeted and r.tries <= 1 else None)}

    async def acquire(self, r: Request, backends: Sequence[tuple[str, int]], until: float | None) -> str:
        if self._refusing or self._closed:
            raise Refused("closed", "the gateway is closing")
        if not backends:
            backends = [(r.backend or "", 1)]
        pool = r.flow.pool
        old = self._att.pop(r.id, None)
        if old is not None:  # an earlier attempt never reported its end: give it back
            self._over(old, None, r)
        a = self._att[r.id] = _Attempt(f"{self.gateway_id}:{r.id}:{r.tries}", pool)
        a.payload = self._candidate(r, a, backends)
        a.flow = "\t".join(map(str, r.flow))
        a.request = r
        a.fut = asyncio.get_running_loop().create_future()
        a.at = self.clock()
        self._pending.setdefault(pool, {})[a.member] = a
        self._kick(pool)
        try:
            if until is None:
                backend = await asyncio.shield(a.fut)
            else:
                backend = await asyncio.wait_for(asyncio.shield(a.fut), max(0.0, until - self.clock()))
        except asyncio.TimeoutError:
            self._give_up(a)
            raise Refused(r.drop_reason or "queue_timeout",
                          "the request's queue age ran out before the gateways' shared state granted its start"
                          + ("" if self.available else f" ({self.reason})")) from None
        except asyncio.CancelledError:
            self._give_up(a)
            raise
        except Refused:
            self._give_up(a)
            raise
        return backend

    def _kick(self, pool: str, poll: bool = False) -> None:
        """Something changed for the pool (a new candidate, a release, a wake-up from another
        gateway, a timer: ``poll``): make a round trip now, unless :data:`MAX_CALLS` are in
        flight and none is new (then again right after one of them answers), or all it would
        carry may wait for company (:meth:`_quiet`). Degraded: grant what this gateway's slices
        allow, in its own order."""
        if self._closed:
            return
        if self.degraded:
            self._grant_alone(pool)
            return
        self._dirty[pool] = True
        if not self._connected:
            return  # _go_up kicks every pool
        lead = self._lead
        if (self._leading and lead is not None and self._lead_evt is not None and not self._rejoining
                and (lead.waiting(pool) or self._own.get(pool))):
            # the decider's own, while candidates wait in the pool: decided on at once, to Redis
            # with its next round trip (_take_own); uncontended, the OFFER's start at once
            # places by what Redis holds, fresher than the decider's view of the others' releases
            if not self._calls.get(pool):  # (else the OFFER in flight kicks again when it answers)
                self._dirty[pool] = False
                self._lead_evt.set()
            return
        if self._calls.get(pool, 0) >= MAX_CALLS:
            return  # a call in flight looks again when it answers
        pending = self._pending.get(pool, {})
        releases = self._releases.get(pool, [])
        if (not releases and not self._adj.get(pool) and not self._withdrawn.get(pool)
                and not any(not a.inflight for a in pending.values())):
            return
        if not releases and not self._withdrawn.get(pool) and not (self._adj.get(pool) and poll):
            wait = self._quiet(pool, pending.values())
            if wait is not None:  # nothing to say that cannot wait for company (or a lost message)
                self._arm(pool, wait)
                return
        self._dirty[pool] = False
        self._calls[pool] = self._calls.get(pool, 0) + 1
        self._spawn(self._one_call(pool))

    async def _one_call(self, pool: str) -> None:
        """One round trip for the pool: the candidates the engine handed on since the last one
        (each flow's next ones up to the cap, its head first: the engine hands requests on in
        their flow's order), prices that moved, candidates that left, corrections and
        releases; and this gateway's grants (of every pool) that the decider made."""
        pending = self._pending.setdefault(pool, {})
        releases = self._releases.setdefault(pool, [])
        withdrawn = self._withdrawn.setdefault(pool, [])
        new, prices, batch = self._take_candidates(pool)
        rel = releases[:]
        releases.clear()
        w = withdrawn[:]
        withdrawn.clear()
        adj = self._take_adj(pool)
        res: dict[str, Any] | None = None
        what = "+".join(n for n, x in (("c", new), ("p", prices), ("w", w), ("a", adj), ("rel", rel)) if x) or "look"
        self.offers_by[what] = self.offers_by.get(what, 0) + 1
        try:
            res = await self._call_json("OFFER", {**self._pool_args(pool), "c": new, "p": prices, "w": w, "a": adj,
                                                  "rel": rel, "seen": self._lease_keys[pool], "resign": False})
        except StateUnavailable:
            pass  # the releases are lost (those leases expire by themselves), and the corrections
        finally:
            for a in batch:
                a.inflight = False
            self._calls[pool] -= 1
        if res is not None:
            at = self.clock()
            for key, c in zip(self._lease_keys[pool], _list(res.get("seen"))):
                self._seen[key] = (at, int(c))
            if "wc" in res:
                self._waiting[pool] = (at, int(res["wc"]))
            for a in batch:
                a.known = True
            lost = set(_list(res.get("lost")))
            for a in batch:
                if a.member in lost:  # Redis no longer knew it (a restart): sent whole next time
                    a.known = False
            if res.get("became") or res.get("lead") == self.gateway_id:
                if not self._leading:
                    log.info("this gateway decides the fleet's order now")
                self._leading = True
                if self._lead_evt is not None and self._lead is None:  # (it starts: from what Redis holds)
                    self._lead_evt.set()
            elif self._leading:  # another gateway took the role over (this one was too slow to renew it)
                self._leading = False
                self._lose_lead()
            for m, backend, keys in _list(res.get("g")):
                self._grant(str(m), str(backend), [str(k) for k in _list(keys)])
        if self._dirty.get(pool) or releases or withdrawn:
            self._kick(pool)
        elif self._adj.get(pool):  # corrections alone wait for company, ADJUST_DELAY at most
            self._arm(pool, ADJUST_DELAY)
        if pending:
            self._arm(pool, GRANT_POLL)

    def _take_candidates(self, pool: str) -> tuple[list[Any], list[Any], list[_Attempt]]:
        """The pool's candidates for a round trip: the new ones (each flow's next up to the
        cap, its head first: the engine hands requests on in their flow's order, whole) and
        the known ones whose price moved (``[member, cost, guess]``); each marked in flight."""
        pending = self._pending.setdefault(pool, {})
        cap = self._cap[pool]
        per_flow: dict[str, int] = {}
        for a in pending.values():
            if a.registered and a.known:
                per_flow[a.flow] = per_flow.get(a.flow, 0) + 1
        new, prices, batch = [], [], []
        for a in pending.values():
            if a.inflight:
                continue
            if not a.known:
                n = per_flow.get(a.flow, 0)
                if n >= cap:
                    continue
                per_flow[a.flow] = n + 1
                a.registered = True
                new.append(self._priced(a, True))
            else:
                x = self._priced(a, False)
                if x is None:
                    continue
                prices.append(x)
            a.inflight = True
            batch.append(a)
        return new, prices, batch

    def _grant(self, member: str, backend: str, keys: list[str]) -> None:
        """The decider granted ``member`` a start on ``backend`` (``keys``: the leases Redis
        took for it). One whose caller gave up meanwhile is given back at once."""
        try:
            a: _Attempt | None = self._att.get(int(member.split(":")[-2]))
        except (ValueError, IndexError):
            a = None
        if a is not None and a.member != member:
            a = None
        if a is not None and a.granted:
            return  # granted already (the message, then the round trip; or alone, while Redis was lost)
        if a is not None and a.request is not None and a.fut is not None and not a.fut.done():
            self._pending[a.pool].pop(member, None)
            self._granted(a.request, a, backend)
            a.fut.set_result(backend)
            return
        pool = keys[0][len(self.prefix) + len("lease:pool:"):] if keys else ""
        if a is not None:
            self._pending[a.pool].pop(member, None)
        if pool in self.policy.pools:
            self._releases.setdefault(pool, []).append({"m": member, "keys": keys, "tok": None})
            self._kick(pool)

    # ------------------------------------------------------------ the fleet's decider
    async def _lead_loop(self) -> None:
        """While this gateway is the fleet's decider: a round trip whenever something happened
        (a gateway's events, published on ``P wake``; its own decisions to send), and every
        :data:`LEAD_POLL` seconds anyway (its role renewed, a bucket's refill, the dead's expiry)."""
        assert self._lead_evt is not None
        evt = self._lead_evt
        while not self._closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(evt.wait(), LEAD_POLL)
            evt.clear()
            if not self._leading or not self._connected or self._rejoining:
                continue
            try:
                await self._decide()
            except StateUnavailable:
                pass
            except Exception:  # (never the loop's end: the next round trip starts the decider again)
                log.exception("sfq: the fleet's decider failed; starting it again from what Redis holds")
                self._lose_lead()

    def _lose_lead(self) -> None:
        """The decider's queues are gone (its role lost, Redis lost, a reload, a failure): its
        own gateway's items that Redis has not taken go back to be sent (by ``OFFER``, or by
        the next decider's first round trip)."""
        self._lead = None
        self._decided = []
        self._requeue_own()

    def _requeue_own(self, kick: bool = True) -> None:
        for pool, own in self._own.items():
            self._releases.setdefault(pool, [])[:0] = own.get("rel", [])
            self._withdrawn.setdefault(pool, [])[:0] = own.get("w", [])
        for pool, adj in self._own_adj.items():
            per = self._adj.setdefault(pool, {})
            for m, d in adj.items():
                per[m] = per.get(m, 0.0) + d
        for a in self._own_att:
            a.inflight = False
            a.known = False  # sent whole again
        had = bool(self._own or self._own_att)
        self._own, self._own_att, self._own_adj = {}, [], {}
        if had and kick and not self._closed:
            for pool in list(self._pending) + list(self._releases):
                self._kick(pool)

    def _take_own(self, lead: Alone) -> None:
        """The decider's own gateway's candidates, prices, withdrawals, corrections and
        releases (what ``OFFER`` carries for another gateway), applied to its queues now and
        kept for its next round trip (``DECIDE`` writes them before its grants). A pool with an
        ``OFFER`` in flight waits for its answer (its events come back in order first)."""
        for pool in self.policy.pools:
            if self._calls.get(pool):
                continue
            own = self._own.setdefault(pool, {"c": [], "p": [], "w": [], "rel": []})
            for m, d in self._take_adj(pool):
                lead.correct(m, float(d))
                per = self._own_adj.setdefault(pool, {})
                per[m] = per.get(m, 0.0) + d
            rel, self._releases[pool] = self._releases.get(pool, []), []
            for r in rel:
                lead.done(r["m"], r["tok"])
            own["rel"].extend(rel)
            w, self._withdrawn[pool] = self._withdrawn.get(pool, []), []
            for m in w:
                lead.remove(m)
            own["w"].extend(w)
            new, prices, batch = self._take_candidates(pool)
            for c in new:
                self._stand_in(lead, {**c, "t": "c"})
            for m, cost, guess in prices:
                lead.price(m, float(cost), bool(guess))
            own["c"].extend(new)
            own["p"].extend(prices)
            self._own_att.extend(batch)
        self._own = {p: o for p, o in self._own.items() if any(o.values())}

    async def _decide(self) -> None:
        """One round trip of the decider: its own gateway's items and its last decisions to
        Redis, what happened since back, and the next decisions (the engine's ``pop`` over the
        stand-ins). Its own new candidates and releases are decided on before the round trip
        (a release and the start it frees go together). Nothing urgent (no grant, no release,
        its role renewed less than :data:`LEAD_POLL` ago, no look at what is live due): no
        round trip; what it has waits for the next."""
        init = self._lead is None
        now = self.clock()
        live = init or now - self._live_at >= LIVE_EVERY
        if not init:
            assert self._lead is not None
            self._take_own(self._lead)
            self._decide_now(self._lead)
        if (not init and not live and not self._decided and now - self._decide_at < LEAD_POLL
                and not any(o["rel"] for o in self._own.values())):
            return
        assert self._lead_evt is not None
        self._lead_evt.clear()  # (what comes while the call is out wakes the loop again)
        grants, self._decided = self._decided, []
        own, batch, own_adj = self._own, self._own_att, self._own_adj
        self._own, self._own_att, self._own_adj = {}, [], {}
        mark = self._applied_q
        self._decide_at = now
        try:
            res = await self._call_json("DECIDE", {"gw": self.gateway_id, "lease": self.lease, "ttl": self._ttl,
                                                   "init": init, "live": live, "pools": list(self.policy.pools),
                                                   "upto": mark, "g": [list(x) for x in grants],
                                                   "seen": self._lease_keys_all if grants or own else [],
                                                   "own": own, "plim": self._plim, "slices": self._table_out,
                                                   "leads": self._leads_out})
        except BaseException:
            self._own, self._own_att, self._own_adj = own, batch, own_adj  # (sent again, by OFFER)
            self._lose_lead()
            raise
        if self._leads_out is not None and isinstance(res.get("lv"), str):  # (what it wrote, kept as is)
            self._leads_v, self._leads_in = res["lv"], self._leads_sent
        self._table_out = self._leads_out = None
        # events a message brought while the call was out are newer than what it saw alive
        live = live and self._applied_q == mark and not self._decided
        if not res.get("ok"):
            log.info("another gateway decides the fleet's order now (%s)", res.get("lead") or "none")
            self._own, self._own_att, self._own_adj = own, batch, own_adj  # (not taken: sent again, by OFFER)
            self._leading = False
            self._lose_lead()
            return
        for a in batch:
            a.inflight = False
            a.known = True
        full = [json.loads(c) for c in _list(res.get("full"))]
        self.decisions += len(grants) - len(_list(res.get("gone"))) - len(full)
        if live:
            self._live_at = now
        lead = self._lead
        if lead is None:
            lead = self._lead = Alone.fleet(self.policy, clock=self.clock, estimator=self.estimator)
            self._applied_q = int(res.get("q") or 0)
            for m, run in _list(res.get("run")):
                x = json.loads(run)
                if x.get("pool") in self.policy.pools:
                    lead.adopt(str(m), Flow(*x["flow"]), str(x["b"]))
            for c in sorted((json.loads(c) for c in _list(res.get("cand"))), key=lambda c: c.get("seq", 0)):
                self._stand_in(lead, c)
            lead.restore(_leads_of(res.get("leads")))  # the last decider's (at most lease/2 old): not forgiven
        else:
            for m in _list(res.get("gone")):
                lead.undo(str(m))
            for c in full:  # Redis holds more than the decider knows of: waiting again, and nothing
                lead.undo(str(c["m"]))  # more is granted until the decider hears something new
                self._stand_in(lead, c)
            if full:
                self._hold = (self._applied_q, now)
            self._take_events(lead, [json.loads(e) for e in _list(res.get("ev"))], fill=True)
        for m, backend, keys in _list(res.get("mine")):  # its own gateway's grants
            self._grant(str(m), str(backend), [str(k) for k in _list(keys)])
        if live:
            waiting, running = lead.members()
            for m in waiting - set(_list(res.get("lc"))):
                lead.remove(m)
            for m in running - set(_list(res.get("lr"))):
                lead.done(m, None)
            if now - self._table_at >= max(self.lease / 2, 1.0):  # (at most every lease/2: _slices)
                self._table_at = now
                table = shares_table(lead.demand(self.policy), [str(g) for g in _list(res.get("gw"))])
                self._table_out = json.dumps({"v": f"{self.gateway_id}:{now:.6f}", "s": table})
                self._leads_sent = lead.leads()
                self._leads_out = json.dumps(self._leads_sent, separators=(",", ":"))
        self._decide_now(lead)
        if init:
            self._lead_evt.set()  # (its own gateway's items: with the next)

    def _take_events(self, lead: Alone, evs: list[dict[str, Any]], fill: bool = False) -> bool:
        """Apply the events after the last applied, in their order; ``True`` when one is
        missing (a message lost: those after it wait for the round trip that fetches it).
        ``fill``: the events Redis kept (after a gap, nothing newer need wait for it)."""
        for e in sorted(evs, key=lambda e: int(e.get("q", 0))):
            q = int(e.get("q", 0))
            if q <= self._applied_q:
                continue
            if q != self._applied_q + 1 and not fill:
                return True
            self._applied_q = q
            try:
                self._event(lead, e)
            except (ValueError, KeyError, TypeError, AttributeError):  # (a gateway's bad record: not the fleet's end)
                log.warning("sfq: the fleet's decider skipped an event it cannot read: %.200r", e)
        return False

    def _decide_now(self, lead: Alone) -> None:
        """The next starts the decider's queues allow, for its next round trip to write."""
        wake = math.inf
        n = len(self._decided)
        if self._hold is not None:
            if self._applied_q == self._hold[0] and self.clock() - self._hold[1] < LEAD_POLL:
                return  # (the loop looks again within LEAD_POLL)
            self._hold = None
        for pool in self.policy.pools:
            while True:
                nxt = lead.next(pool)
                if nxt is None:
                    break
                self._decided.append((nxt[0], nxt[1], pool))
            w = lead.wake_at(pool)
            if w is not None:
                wake = min(wake, w)
        assert self._lead_evt is not None
        if len(self._decided) > n:
            self._lead_evt.set()
        elif wake < math.inf:  # a bucket refills: look again then (one timer, the soonest)
            loop = asyncio.get_running_loop()
            at = loop.time() + max(wake - self.clock(), 0.001)
            h = self._wake_timer
            if h is None or h.cancelled() or h.when() > at or h.when() < loop.time():
                if h is not None:
                    h.cancel()
                self._wake_timer = loop.call_later(at - loop.time(), self._lead_evt.set)

    def _stand_in(self, lead: Alone, c: dict[str, Any]) -> None:
        if c.get("pool") not in self.policy.pools:
            return
        try:
            flow = Flow(*c["flow"])
            self.policy.classes[flow.cls]
        except (TypeError, KeyError):
            return  # (not this policy's: a gateway of another policy, refused at its next renewal)
        if c.get("t") == "s":  # it started at once (nothing waited in its pool): charged as it started
            lead.start(str(c["m"]), flow, float(c["cost"]), float(c["tokens"]), str(c["b"]), bool(c.get("guess")))
            return
        dl = c.get("dl")
        lead.add(str(c["m"]), flow, float(c["cost"]), float(c["tokens"]), [str(b) for b in _list(c["backends"])],
                 bool(c.get("guess")), None if dl is None else float(dl))

    def _event(self, lead: Alone, e: dict[str, Any]) -> None:
        t, m = e.get("t"), str(e.get("m"))
        if t == "c" or t == "s":
            self._stand_in(lead, e)
        elif t == "p":
            lead.price(m, float(e["cost"]), bool(e.get("guess")))
        elif t == "w":
            lead.remove(m)
        elif t == "a":
            lead.correct(m, float(e["d"]))
        elif t == "r":
            tok = e.get("tok")
            lead.done(m, None if tok is None else float(tok))
        elif t == "u" and m not in lead:
            x = json.loads(e["run"])
            if x.get("pool") in self.policy.pools:
                lead.adopt(m, Flow(*x["flow"]), str(x["b"]))

    def _grant_alone(self, pool: str) -> None:
        """Degraded: grant the pool's candidates that this gateway's slices of the global limits
        allow, in the engine's order (:class:`~sfq.state._local.Alone`: the engine's queue of
        the sliced policy over stand-ins of the candidates)."""
        pending = self._pending.get(pool)
        if not pending or self._rejoining:
            return
        alone = self._alone_now()
        for a in pending.values():  # (in arrival order: each flow's head first)
            r = a.request
            if r is None:
                continue
            if a.member not in alone:
                alone.add(a.member, r.flow, a.payload["cost"], a.payload["tokens"], a.payload["backends"])
            elif self.reprice is not None and not a.payload["strict"]:  # priced at the grant, as with Redis
                alone.price(a.member, self.reprice(r))
        while True:
            nxt = alone.next(pool)
            if nxt is None:
                break
            m, backend = nxt
            a = pending.pop(m)
            assert a.request is not None and a.fut is not None
            a.local = True
            self._granted(a.request, a, backend)
            if not a.fut.done():
                a.fut.set_result(backend)
            else:  # its caller gave up meanwhile: give it back
                self._release(a, None, a.request)
        wake = alone.wake_at(pool)
        if pending and wake is not None:  # a bucket refills: look again then (a release kicks sooner)
            self._arm(pool, max(wake - self.clock(), 0.001))
        if pending and self._alone_first:  # the slices widen when the first lease_seconds are over
            assert self.degraded_since is not None
            self._arm(pool, max(self.degraded_since + self.lease - self.clock(), 0.001))

    def _alone_now(self) -> Alone:
        """The engine's queues of this gateway's slices (made when first needed, and again when
        the first lease_seconds alone are over), with what it holds adopted as running."""
        now = self.clock()
        since = self.degraded_since if self.degraded_since is not None else now
        first = now - since < self.lease
        if self._alone is not None and self._alone_first == first:
            return self._alone
        sl = self._slices()
        p = self.prefix

        def part(name: str, limit: int) -> int:
            """This gateway's part of ``limit`` alone: its slice; in the first lease_seconds, no
            more than it held when Redis was lost and its slice of what was left then (as its
            last round trip saw it, within SEEN_FRESH seconds; else nothing was left): the
            others may still hold more than their slices then."""
            mine = sl.count(limit)
            if not first:
                return mine
            key = f"{p}lease:{name}"
            at, n = self._seen.get(key, (-math.inf, limit))
            left = limit - n if since - at <= SEEN_FRESH else 0
            return min(mine, self._held_at_loss.get(key, 0) + sl.count(max(0, left)))

        # the meters: where the last alone left them, else the fleet's as last seen (at most a
        # table's period and a renewal's old), not level: a quiet org does not queue behind the
        # flows that ran ahead of it the moment Redis is lost
        leads = self._alone.leads() if self._alone is not None else self._leads_in
        alone = self._alone = Alone(self.policy, part, sl, clock=self.clock, estimator=self.estimator)
        alone.restore(leads)
        self._alone_first = first
        for a in self._att.values():
            if a.granted and a.request is not None and a.request.backend is not None:
                alone.adopt(a.member, a.request.flow, a.request.backend)
        return alone

    def _holding(self) -> dict[str, int]:
        """Lease key -> this gateway's granted attempts holding it."""
        held: dict[str, int] = {}
        for x in self._att.values():
            if x.granted:
                for k in x.keys:
                    held[k] = held.get(k, 0) + 1
        return held

    def _priced(self, a: _Attempt, whole: bool) -> Any:
        """What a round trip sends of the candidate ``a``: the whole of it (``whole``: the first
        time, or again when Redis lost it), else ``[member, cost, guess]`` when the engine's
        calibration moved since it was sent (``reprice``: the grant charges the price at the
        grant, as one engine charges the estimate at dispatch; a candidate handed on before its
        flow's first usage report would otherwise be granted, maybe many seconds later, at the
        prior's price), else ``None``."""
        p = a.payload
        r = a.request
        if self.reprice is None or r is None or p["strict"]:
            return p if whole else None
        cost = self.reprice(r)
        guess = bool(self._flow_work and self.estimator is not None and guessed(r, self.estimator))
        changed = cost != p["cost"] or guess != p["guess"]
        p["cost"], p["guess"] = cost, guess
        if whole:
            return p
        return [a.member, cost, guess] if changed else None

    def _arm(self, pool: str, wait: float) -> None:
        """Look again in ``wait`` seconds at the latest (a lease of a dead gateway expires, a
        bucket refills, a wake-up was lost)."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        at = loop.time() + wait
        h = self._timers.get(pool)
        if h is not None and not h.cancelled() and h.when() <= at:
            return
        if h is not None:
            h.cancel()
        self._timers[pool] = loop.call_later(wait, self._on_timer, pool)

    def _on_timer(self, pool: str) -> None:
        self._timers.pop(pool, None)
        self._kick(pool, poll=True)

    def _contended(self, pool: str, now: float) -> bool:
        """Whether candidates wait in ``pool`` (over every gateway), as a round trip or a message
        said within :data:`FULL_FRESH` seconds: a new candidate cannot start at once then, it
        waits for the decider's grant whatever it does."""
        at, n = self._waiting.get(pool, (-math.inf, 0))
        return n > 0 and now - at <= FULL_FRESH

    def _quiet(self, pool: str, pending: Any) -> float | None:
        """Seconds the pool's next round trip may wait, or ``None`` (now), when only candidates
        are to be sent or looked after. A new one waits up to :data:`CANDIDATE_DELAY` for
        company (a release of this gateway's; a closed-loop client's, usually) when it could
        not start at once anyway (:meth:`_contended`) and its flow has a candidate waiting at
        the decider from this gateway already (it stays backlogged there: an idle flow's
        first, seen late, would lose its place in the order); a strict class's, or one with a
        deadline, never waits. A look for the known ones' grants is needed only when a message that brings
        grants may have been lost: none heard for :data:`GRANT_POLL` seconds, or the
        subscription is newer than that (else :data:`GRANT_POLL` later)."""
        now = self.clock()
        wait = math.inf
        pending = list(pending)
        ahead = {a.flow for a in pending if a.known}
        for a in pending:
            if a.inflight:
                continue
            if not a.known:
                p = a.payload
                if (p.get("strict") or p.get("dl") is not None or now - a.at >= CANDIDATE_DELAY
                        or a.flow not in ahead or not self._contended(pool, now)):
                    return None
                wait = min(wait, a.at + CANDIDATE_DELAY - now)
            else:  # known: a look for its grant
                if now - self._heard_at >= GRANT_POLL or now - self._subscribed_at < GRANT_POLL:
                    return None
                wait = min(wait, GRANT_POLL)
        return max(wait, 0.001) if wait < math.inf else None

    def _granted(self, r: Request, a: _Attempt, backend: str) -> None:
        p = self.prefix
        flow = r.flow
        a.granted = True
        a.keys = [f"{p}lease:pool:{flow.pool}", f"{p}lease:backend:{backend}"]
        if self._org(flow.org).max_in_flight is not None:
            a.keys.append(f"{p}lease:org:{flow.org}")
        if self.policy.classes[flow.cls].max_in_flight is not None:
            a.keys.append(f"{p}lease:class:{flow.cls}")
        self._queued.pop(r.id, None)

    def _give_up(self, a: _Attempt) -> None:
        """The candidate leaves without a grant (its wait ran out, its caller went away, or the
        gateway closes); a grant in flight is given back by the driver."""
        self._pending.get(a.pool, {}).pop(a.member, None)
        if self._alone is not None:
            self._alone.remove(a.member)
        if a.request is not None and self._att.get(a.request.id) is a:
            del self._att[a.request.id]
        if a.fut is not None and a.fut.done() and not a.fut.cancelled() and a.fut.exception() is None:
            if a.request is not None:  # granted just now: give it back
                self._release(a, None, a.request)
            return
        if not self._closed and a.registered and self._connected:  # the decider learns it, next round trip
            self._withdrawn.setdefault(a.pool, []).append(a.member)
            self._kick(a.pool)

    def _over(self, a: _Attempt, actual_tokens: float | None, r: Request) -> None:
        if a.granted:
            self._release(a, actual_tokens, r)
        else:
            self._give_up(a)

    def attempt_over(self, r: Request, actual_tokens: float | None) -> None:
        a = self._att.pop(r.id, None)
        if a is not None:
            self._over(a, actual_tokens, r)
        if r.retrying:
            self._retry_over(r)

    def _retry_over(self, r: Request) -> None:
        out = self._retrying.pop(r.id, None)
        if out is not None:
            self._spawn(self._withdraw(list(out)))

    async def retry_allowed(self, r: Request) -> bool:
        if not self._budgeted:
            return True
        if self.degraded:
            return True  # alone, the retry is bounded by max_attempts (the budget is the fleet's)
        if not self._connected:
            return False  # the budget cannot be checked: no retry rather than one past it
        f = r.flow
        base = f"{self.prefix}rb:%s:{f.org}\t{f.cls}\t{f.pool}"
        member = f"{self.gateway_id}:{r.id}:{r.tries}"
        try:
            res = await self._call("RETRY", {"first": base % "first", "retry": base % "retry", "out": base % "out",
                                             "pct": self.policy.retry.budget_per_flow_percent, "lease": self.lease,
                                             "m": member})
        except StateUnavailable:
            return False
        if res[0] != 1:
            return False
        self._retrying[r.id] = (base % "out", member)
        return True

    def ended(self, r: Request) -> None:
        self._user_live(self._user_req.pop(r.id, None), -1)
        self._retry_over(r)
        q = self._queued.pop(r.id, None)
        if q is not None:
            self._spawn(self._withdraw(list(q)))

    def charged(self, r: Request, delta: float) -> None:
        """The engine corrected the charge of ``r``'s flow by ``delta`` cost units (a stream's
        delivered tokens, a settlement, a refund): once its attempt was granted (the grant
        charged the engine's charge at dispatch in Redis), the correction reaches the shared
        meter with the pool's next round trip, atomically. Corrections made before the grant
        (the engine re-pricing the request as it hands it on) are already in that charge."""
        a = self._att.get(r.id)
        if a is None or not a.granted or self._closed:
            return
        if a.local or not self._connected:  # granted alone, or alone now: the meter of the engine's queue alone
            if self._alone is not None:
                self._alone.correct(a.member, delta)
            return
        per = self._adj.setdefault(a.pool, {})
        per[a.member] = per.get(a.member, 0.0) + delta
        self._arm(a.pool, ADJUST_DELAY)  # a stream's charges ride on a round trip at most this much later

    def _take_adj(self, pool: str) -> list[list[Any]]:
        per = self._adj.pop(pool, None)
        return [[m, d] for m, d in per.items() if d] if per else []

    def _release(self, a: _Attempt, actual_tokens: float | None, r: Request) -> None:
        """Give the attempt's slots back, in the pool driver's next round trip (with the grants
        it makes); a usage report corrects the tokens bucket by the difference."""
        tok = None
        if actual_tokens is not None and math.isfinite(actual_tokens):
            tok = float(actual_tokens)
        if self._closed:
            return
        if self._alone is not None:
            self._alone.done(a.member, actual_tokens)  # its slots free (alone), its work ends
        if a.local and not self._connected:  # granted alone, ended alone: Redis never had it
            self._kick(a.pool)
            return
        rel = {"m": a.member, "keys": a.keys, "tok": tok}
        self._releases.setdefault(a.pool, []).append(rel)
        # a closed-loop client's next request follows at once: one round trip carries both
        self._arm(a.pool, RELEASE_DELAY)

    async def _withdraw(self, q: list[str]) -> None:
        """A waiting place (or an outstanding retry) given back."""
        if not self._connected:
            return  # (what it held expires in Redis by itself)
        with contextlib.suppress(StateUnavailable):
            await self._call("WITHDRAW", {"q": q})

    # ------------------------------------------------------------ spend (budgets)
    def _spend_key(self, account: str, period: str) -> str:
        """``account``: an org (its own budget) or ``org<TAB>team`` (a team's)."""
        return f"{self.prefix}spend:{account}:{period}"

    async def reserve_spend(self, hold: Hold, budgets: Sequence[tuple[str, str, float]], keep: float) -> list[int]:
        """Reserve ``hold.amount`` in every budget of ``budgets`` (``(account, period,
        limit)``: an org's own, ``org<TAB>team`` a team's) or in none, atomically over every
        gateway (a lease, renewed while the request runs; freed within ``lease_seconds`` if
        this gateway dies); returns the indexes of those that cannot cover it (empty: held in
        all). ``keep``: seconds the periods' keys must live. Degraded: this gateway's slice of
        what was left of each when Redis was lost; ``Refused("state_unavailable")`` when Redis
        cannot be reached and this gateway never saw one of the budgets' periods (it cannot know
        what is left)."""
        hold.member = f"{self.gateway_id}:s{next(self._tickets)}"
        keys = [self._spend_key(acc, per) for acc, per, _ in budgets]
        if self._connected:
            try:
                res: dict[str, Any] | None = await self._call_json(
                    "SPEND_RESERVE", {"ks": [[k, lim] for k, (_, _, lim) in zip(keys, budgets)], "m": hold.member,
                                      "a": hold.amount, "lease": self.lease, "keep": max(1, math.ceil(keep))})
            except StateUnavailable:
                res = None
            if res is not None:
                refused = [int(i) for i in _list(res.get("refused"))]
                for k, left in zip(keys, _list(res.get("left"))):
                    self._budget_left[k] = float(left) - (0.0 if refused else hold.amount)
                if not refused:
                    self._spending[hold.member] = (keys, hold.member)
                return refused
        if not self.degraded:
            raise self._unavailable()
        parts = []
        for k, (acc, per, _) in zip(keys, budgets):
            part = self._budget_slice.get(k)
            if part is None:
                seen = self._budget_left.get(k)
                if seen is None:
                    who = "team {1!r} of org {0!r}".format(*acc.split("\t", 1)) if "\t" in acc else f"org {acc!r}"
                    raise Refused("state_unavailable", f"the gateways' shared state cannot be used ({self.reason}) "
                                                       f"and this gateway has not seen {who}'s budget for {per} "
                                                       "yet: what is left of it is unknown here")
                part = self._budget_slice[k] = max(0.0, seen) / self._slices().n
            parts.append(part)
        refused = [i for i, part in enumerate(parts) if hold.amount > part or (hold.amount <= 0 and part <= 0)]
        if refused:
            return refused
        for k in keys:
            self._budget_slice[k] -= hold.amount
        self._local_holds[hold.member] = (keys, hold.amount)
        self._spending[hold.member] = (keys, hold.member)
        return []

    def settle_spend(self, hold: Hold, actual: float) -> None:
        """The request of ``hold`` ended having spent ``actual``: the shared ledger takes it in
        each budget it was reserved in (with the next renewal when Redis cannot be reached now)."""
        entry = self._spending.pop(hold.member, None)
        if entry is None:
            return
        alone = self._local_holds.pop(hold.member, None)
        if alone is not None:  # reserved alone: each slice keeps the difference
            for k in alone[0]:
                if k in self._budget_slice:
                    self._budget_slice[k] += alone[1] - actual
        payload = {"ks": entry[0], "m": hold.member, "s": actual, "keep": 3 * 86400 + 31 * 86400}
        self._spawn(self._settle(payload))

    async def _settle(self, payload: dict[str, Any]) -> None:
        try:
            await self._call("SPEND_SETTLE", payload)
        except StateUnavailable:
            self._unsettled.append(payload)

    async def spent(self, org: str, period: str, team: str | None = None) -> float:
        """What ``org`` (or its ``team``) spent in ``period`` over every gateway (settled
        requests; for tests)."""
        assert self._client is not None
        acc = org if team is None else f"{org}\t{team}"
        v = await asyncio.wait_for(self._client.hget(self._spend_key(acc, period), "s"), self.timeout)
        return float(v) if v is not None else 0.0

    # ------------------------------------------------------------ views
    def stats(self) -> dict[str, Any]:
        return {"kind": "redis", "available": self.available, "degraded": self.degraded, "reason": self.reason,
                "gateway": self.gateway_id, "gateways": len(self._gateways), "on_loss": self.spec.on_loss,
                "prefix": self.prefix, "lease_seconds": self.lease,
                "holding": sum(a.granted for a in self._att.values()),
                "candidates": sum(not a.granted for a in self._att.values()), "round_trips": self.round_trips,
                "round_trips_by_script": dict(self.trips_by), "offers_by_content": dict(self.offers_by),
                "candidates_by_pool": {p: len(v) for p, v in self._pending.items()},
                "decider": self._leading, "decisions": self.decisions}

    def decider(self, pool: str) -> PolicyQueue | None:
        """The fleet's decider's queue of ``pool`` when this gateway decides (its meters are the
        fleet's), else ``None`` (for tests and operators' views)."""
        lead = self._lead if self._leading else None
        return None if lead is None else lead.queues.get(pool)

    async def global_counts(self) -> dict[str, int]:
        """Every lease set's live count (for tests and ``/health``)."""
        assert self._client is not None
        out = {}
        now = float((await asyncio.wait_for(self._client.time(), self.timeout))[0])
        async for k in self._client.scan_iter(match=f"{self.prefix}lease:*"):
            key = k.decode() if isinstance(k, bytes) else k
            out[key[len(self.prefix) + 6:]] = int(await asyncio.wait_for(
                self._client.zcount(key, f"({now}", "+inf"), self.timeout))
        return out
