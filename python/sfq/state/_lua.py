"""The Lua scripts that change the shared state in Redis, each atomically in one round trip.

Every time in them is Redis's own (``TIME``): a lease's expiry, a bucket's refill and a
candidate's staleness never depend on a gateway's clock. Each script takes ``ARGV[1]`` (the
key prefix) and ``ARGV[2]`` (a JSON payload) and builds its keys from the prefix: the state
needs one Redis server (or a primary), not a Redis Cluster.

Redis computes no order and charges no meter: the fleet's decider (one gateway, running the
engine's own queues: docs/design.md §5a.1) does. The scripts move its inputs and the records
that must outlive any one gateway. Keys (``P`` = the prefix):

* ``P lease:<kind>:<name>`` sorted set: a slot held (``<gateway>:<request>:<try>``) scored by
  its expiry; ``kind`` is ``pool``, ``backend``, ``org`` or ``class``.
* ``P bucket:<name>`` hash ``l`` (level), ``t`` (time): a token bucket (an org's rate, at
  admission; below 0 while requests wait for tokens taken ahead, ``on_limit: wait``); absent =
  full. The pools' buckets are the decider's.
* ``P cand:<pool>`` hash member -> a waiting candidate (JSON: its flow, price, tokens, the
  backends it may use, its slot groups, waiting place and retry-budget key), ``P cexp``
  sorted set: every candidate's expiry (renewed by its gateway); ``P seq``: their order of
  arrival.
* ``P ev`` sorted set: the events the decider may not have yet, scored by their order (``P
  evq``), also published to it (JSON events: ``c`` a candidate, ``s`` one started at once,
  ``p`` a new price, ``w`` a withdrawal, ``a`` a correction of a running attempt's charge,
  ``r`` a release, ``u`` a running attempt put back; each with its order ``q``).
* ``P run`` hash member -> a running attempt (its pool, flow and backend): what a new decider
  adopts. ``P lead``: the decider's id (expires unless renewed). ``P grant:<gateway>`` hash
  member -> the grant (backend, leases) until the gateway's next round trip takes it.
* ``P queue:<pool>:<class>`` sorted set: the class's waiting requests (max_queue_length),
  each member ending with a tab and its org. ``P users:<org><TAB><team>`` sorted set: the
  team's (or org's) live users (max_users), ``<user><TAB><gateway>`` per gateway holding one.
* ``P rb:first|retry:<flow>`` sorted sets: the flow's first attempts and retries over the
  last minute; ``P rb:out:<flow>``: its retries waiting or running (leases): the retry budget.
* ``P wake``: the pub/sub channel: ``e`` and the events (JSON) after a newline, for the
  decider; ``g:<gateway>`` and the grants (JSON) after a newline; ``n`` and the slots the
  pools and backends hold, and the candidates waiting in the pools (JSON ``[[lease key or
  P cand:<pool>, count], ...]``) whenever a grant or a release changed them; ``P evict``: the channel that names a waiting place taken
  from the org holding the most (``ADMIT``).
* ``P gw`` sorted set: the live gateways (their ids, scored by the expiry of their last
  renewal): how many share each limit, and each one's rank, for the slices a gateway keeps
  while Redis cannot be reached. ``P slices``: the decider's table of their shares by demand
  (JSON ``{v, s: {gateway: share}}``), read with each renewal.
* ``P leads``: the decider's meters ahead of its virtual time, per pool and flow (JSON, written
  with the table; ``P leadsv``: when, Redis time): where the next decider starts them, so that
  the role moving forgives no flow the service it took ahead, and where a gateway left alone
  starts them (each renewal brings them when newer than those it has).
* ``P policy``: the hash of the policy in force (expires unless a gateway renews it).
* ``P spend:<account>:<period>`` hash ``s``: what the account (an org, or ``<org><TAB><team>``)
  spent in the period (currency, settled requests); ``... :res`` sorted set: its running
  requests' reservations (leases, renewed by their gateway), ``... :amt`` hash member -> the
  reserved amount. They expire some days after the period ends.
"""

from __future__ import annotations

__all__ = ["ADMIT", "OFFER", "DECIDE", "RENEW", "RETRY", "WITHDRAW", "HELLO", "GATEWAYS", "SPEND_RESERVE",
           "SPEND_SETTLE"]

_COMMON = r"""
local P = ARGV[1]
local A = cjson.decode(ARGV[2])
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local NOW = now_s()
local function fmt(x) return string.format('%.17g', x) end
local function count(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', NOW)
  return redis.call('ZCARD', key)
end
local function level(key, cap, rate)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, t = tonumber(v[1]), tonumber(v[2])
  if l == nil then return cap end
  if NOW > t then l = math.min(cap, l + (NOW - t) * rate) end
  return l
end
-- (OFFER, and DECIDE for the decider's own gateway) a gateway's items as records: a release
-- (its leases freed, no longer running), a withdrawal and a new price of a waiting candidate
-- (false: Redis does not have it), a new candidate queued (its order of arrival, its expiry)
local function release(r)
  for _, k in ipairs(r.keys) do redis.call('ZREM', k, r.m) end
  redis.call('HDEL', P .. 'run', r.m)
end
local function withdraw(cand, m)
  if redis.call('HDEL', cand, m) ~= 1 then return false end
  redis.call('ZREM', P .. 'cexp', m)
  return true
end
local function reprice(cand, x)
  local cj = redis.call('HGET', cand, x[1])
  if not cj then return false end
  local c = cjson.decode(cj)
  c.cost, c.guess = x[2], x[3]
  redis.call('HSET', cand, x[1], cjson.encode(c))
  return true
end
local function queue(cand, c)
  c.seq = redis.call('INCR', P .. 'seq')
  redis.call('HSET', cand, c.m, cjson.encode(c))
  redis.call('ZADD', P .. 'cexp', NOW + A.lease, c.m)
end
-- (GATEWAYS, RENEW) this gateway is alive: the live ones, the decider's table of their shares,
-- and its meters' leads when newer than the caller's
local function alive()
  local k = P .. 'gw'
  redis.call('ZREMRANGEBYSCORE', k, '-inf', NOW)
  redis.call('ZADD', k, NOW + A.lease, A.gw)
  redis.call('PEXPIRE', k, math.ceil(A.lease * 3000))
  local out = {ids = redis.call('ZRANGE', k, 0, -1), table = redis.call('GET', P .. 'slices') or ''}
  local lv = redis.call('GET', P .. 'leadsv')  -- the decider's meters, when newer than the caller's
  if lv and lv ~= A.lv then
    out.lv = lv
    out.leads = redis.call('GET', P .. 'leads') or ''
  end
  return cjson.encode(out)
end
local function bset(key, l, cap, rate)
  if l >= cap then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'l', fmt(l), 't', fmt(NOW))
  redis.call('PEXPIRE', key, math.ceil((cap - l) / rate * 1000) + 1000)
end
"""

#: admission: the org's rate, then a waiting place of the class. A full class's queue is
#: shared fairly (Kubernetes APF's rule): the org holding the most places loses one to an org
#: holding fewer; an org that already holds the most is refused. A place's member ends with a
#: tab and its org; the place taken from another org is published on ``P evict`` (its gateway ends
#: that request as refused, ``queue_full``).
#: A nested flow's user (``u``) is live at a gateway while a request of it waits or runs there
#: (``P users:<org><TAB><team>``: members ``<user><TAB><gateway>``, leases); a user live at no
#: gateway is refused (``too_many_users``) when its team already has ``max_users`` live.
#: Over the org's rate, a request that may wait (``on_limit: wait``: ``h``, the seconds to its
#: deadline, queue age or max_wait, >= 0) takes its token ahead when it refills within ``h``: the
#: bucket goes into debt, so the next admission (at any gateway) waits for the next token, and
#: the wait until this one's refill is returned; ``h`` < 0 (``on_limit: refuse``) or a refill
#: at or after ``h``: refused, with that wait.
#: {m, o (the org), lease, q: [key, max] | null, org: [key, cap, rate, h] | null,
#:  u: [key, user member, max_users] | null}
#: -> {1, the member evicted or '', the wait for its token (seconds; 0: none)} | {0, reason, wait}
ADMIT = _COMMON + r"""
local has_q = A.q ~= cjson.null and A.q ~= nil
local has_u = A.u ~= cjson.null and A.u ~= nil
if has_u then  -- a user not live at any gateway needs room among its team's max_users
  redis.call('ZREMRANGEBYSCORE', A.u[1], '-inf', NOW)
  local seen, n, mine = {}, 0, false
  local u0 = string.match(A.u[2], '^(.*)\t[^\t]*$')
  for _, x in ipairs(redis.call('ZRANGE', A.u[1], 0, -1)) do
    local u = string.match(x, '^(.*)\t[^\t]*$') or x
    if u == u0 then mine = true end
    if not seen[u] then seen[u], n = true, n + 1 end
  end
  if not mine and n >= A.u[3] then return {0, 'too_many_users', '1'} end
end
local evict = ''
if has_q and count(A.q[1]) >= A.q[2] then
  local all = redis.call('ZRANGE', A.q[1], 0, -1, 'WITHSCORES')
  local per, top, topn = {}, nil, 0
  for i = 1, #all, 2 do
    local o = string.match(all[i], '\t(.*)$') or ''
    per[o] = (per[o] or 0) + 1
    if per[o] > topn then top, topn = o, per[o] end
  end
  if top == nil or (per[A.o] or 0) >= topn then return {0, 'queue_full', '1'} end
  -- the newest place of the org holding the most (the largest expiry: the latest renewed)
  local bs = nil
  for i = 1, #all, 2 do
    local x, t = all[i], tonumber(all[i + 1])
    if (string.match(x, '\t(.*)$') or '') == top and (bs == nil or t >= bs) then evict, bs = x, t end
  end
end
local wait = 0
if A.org ~= cjson.null and A.org ~= nil then
  local key, cap, rate, h = A.org[1], A.org[2], A.org[3], tonumber(A.org[4]) or -1
  local l = level(key, cap, rate)
  if l < 1 - 1e-9 then
    wait = (1 - l) / rate
    if h < 0 or wait >= h then return {0, 'rate_limited', fmt(wait)} end
  end
  bset(key, l - 1, cap, rate)
end
if evict ~= '' then
  redis.call('ZREM', A.q[1], evict)
  redis.call('PUBLISH', P .. 'evict', evict)
end
if has_q then
  redis.call('ZADD', A.q[1], NOW + A.lease, A.m)
end
if has_u then
  redis.call('ZADD', A.u[1], NOW + A.lease, A.u[2])
  redis.call('PEXPIRE', A.u[1], math.ceil(A.lease * 3000))
end
return {1, evict, fmt(wait)}
"""

#: A gateway's round trip for one pool (docs/design.md §5a.1: the fleet's decider): what its
#: engine handed on since the last one, as events for the decider (``P ev``), and the grants
#: the decider made for this gateway (of any pool). Corrections of running attempts' charges
#: first (an attempt's last ones ride with its release), then releases (their leases freed),
#: withdrawals (a grant that crossed one comes back here and the gateway gives it back), new
#: candidates, new prices of waiting ones. A new candidate that finds nothing waiting in its
#: pool and room in every limit starts at once (``fast``: the pool has no token buckets, which
#: only the decider keeps), on the least-loaded backend it may use, as one engine starts an
#: uncontended request (``start_alone``); the decider is told (``s``) and charges it. Others
#: join ``P cand:<pool>`` (and ``P cexp``, renewed by their gateway). A gateway that finds no
#: decider becomes it (``P lead``, expiring unless the decider renews it). The events are
#: published to the decider (``P wake``, ``e``) and kept in ``P ev`` until it has them.
#: {gw, lease, ttl, pool, pool_lim (-1: none), fast, c: [{m, pool, flow: [...], cost, tokens, guess,
#:  strict, backends: [names], lims: [their max_in_flight], groups: [[lease key, limit], ...],
#:  q: [key, member] | null, first: key | null}, ...], p: [[m, cost, guess]], w: [m, ...],
#:  a: [[m, delta], ...], rel: [{m, keys, tok | null}, ...], seen: [lease keys], resign: bool}
#: -> JSON {lead (the decider's id or ''), became (this gateway is it now), g: [[m, backend,
#:     keys], ...] (the grants), lost: [members priced that Redis no longer knew], seen: [counts],
#:     wc: the candidates waiting in the pool now}
OFFER = _COMMON + r"""
local cand, ev = P .. 'cand:' .. A.pool, P .. 'ev'
local function has(x) return x ~= nil and x ~= cjson.null end
local evs = {}
local function push(e)
  e.q = redis.call('INCR', P .. 'evq')
  local j = cjson.encode(e)
  redis.call('ZADD', ev, e.q, j)
  evs[#evs + 1] = j
end
for _, x in ipairs(A.a or {}) do push({t = 'a', m = x[1], d = x[2]}) end
for _, r in ipairs(A.rel or {}) do
  release(r)
  push({t = 'r', m = r.m, tok = r.tok})
end
for _, m in ipairs(A.w or {}) do
  if withdraw(cand, m) then push({t = 'w', m = m}) end
end
local g = {}
local plk = P .. 'lease:pool:' .. A.pool
-- the backend an uncontended candidate starts on now, or nil (nothing waits in the pool: every
-- limit with room, the least-loaded of its backends; ties to the first named)
local function at_once(c)
  if not A.fast or redis.call('HLEN', cand) > 0 then return nil end
  if A.pool_lim >= 0 and count(plk) >= A.pool_lim then return nil end
  for _, x in ipairs(c.groups or {}) do
    if count(x[1]) >= x[2] then return nil end
  end
  local best, bn = nil, nil
  for i, b in ipairs(c.backends) do
    local k = count(P .. 'lease:backend:' .. b)
    if k < c.lims[i] and (bn == nil or k < bn) then best, bn = b, k end
  end
  return best
end
for _, c in ipairs(A.c or {}) do
  local b = at_once(c)
  if b then
    local exp = NOW + A.lease
    local keys = {plk, P .. 'lease:backend:' .. b}
    for _, x in ipairs(c.groups or {}) do keys[#keys + 1] = x[1] end
    for _, k in ipairs(keys) do redis.call('ZADD', k, exp, c.m) end
    redis.call('HSET', P .. 'run', c.m, cjson.encode({pool = c.pool, flow = c.flow, b = b}))
    if has(c.q) then redis.call('ZREM', c.q[1], c.q[2]) end
    if has(c.first) then
      redis.call('ZADD', c.first, NOW, c.m)
      redis.call('PEXPIRE', c.first, 61000)
    end
    c.t, c.b = 's', b
    push(c)
    g[#g + 1] = {c.m, b, keys}
  else
    queue(cand, c)
    c.t = 'c'
    push(c)
  end
end
local lost = {}
for _, x in ipairs(A.p or {}) do
  if reprice(cand, x) then
    push({t = 'p', m = x[1], cost = x[2], guess = x[3]})
  else
    lost[#lost + 1] = x[1]
  end
end
local lk = P .. 'lead'
local lead = redis.call('GET', lk) or ''
local became = false
if A.resign then
  if lead == A.gw then redis.call('DEL', lk) end
  lead = ''
elseif lead == '' then
  redis.call('SET', lk, A.gw, 'PX', math.ceil(A.ttl * 1000))
  lead, became = A.gw, true
end
-- the events go to the decider in the message too: it decides without a round trip to fetch them
-- (``P ev`` keeps them until it has them all, for a message lost)
if #evs > 0 then redis.call('PUBLISH', P .. 'wake', 'e\n[' .. table.concat(evs, ',') .. ']') end
local gk = P .. 'grant:' .. A.gw
local got = redis.call('HGETALL', gk)
if #got > 0 then
  redis.call('DEL', gk)
  for i = 1, #got, 2 do
    local x = cjson.decode(got[i + 1])
    g[#g + 1] = {got[i], x.b, x.k}
  end
end
local seen, pairs_ = {}, {}
for _, k in ipairs(A.seen or {}) do
  seen[#seen + 1] = count(k)
  pairs_[#pairs_ + 1] = {k, seen[#seen]}
end
-- the slots held over every gateway, to every gateway, whenever they changed here: what is left
-- of each limit should Redis be lost (docs/gateway.md, "When Redis is lost")
local wc = redis.call('HLEN', cand)
if (#g > 0 or #(A.rel or {}) > 0) and #pairs_ > 0 then
  pairs_[#pairs_ + 1] = {cand, wc}
  redis.call('PUBLISH', P .. 'wake', 'n\n' .. cjson.encode(pairs_))
end
return cjson.encode({lead = lead, became = became, g = g, lost = lost, seen = seen, wc = wc})
"""

#: The fleet's decider's round trip: it is still the decider (``P lead``, renewed), the grants it
#: decided since the last one (each a candidate still in ``P cand:<pool>``: its leases taken, its
#: waiting place freed, its first attempt counted in its flow's retry budget, ``P run`` told,
#: ``P grant:<gw>`` for its gateway, and on ``P wake`` ``g:<gw>`` followed by the grants, so that
#: the gateway needs no round trip to learn them; the others ``gone``: they left meanwhile), then
#: the events after ``upto`` (those the decider did not get in messages: ``P ev``, scored by
#: their order ``P evq``; those up to ``upto`` are dropped). ``init``: a decider that starts (or
#: starts again) takes every candidate and running attempt instead, and the order number they
#: are up to (``q``); ``live``: the live candidates and running attempts too (a gateway that
#: died stops renewing them).
#: The decider's own gateway's items come first (``own``: what ``OFFER`` carries for another
#: gateway, written without events: its queues have them), so that one of its releases and the
#: start it frees go together. A grant is made only if it fits every limit the leases count
#: (``plim``: each pool's ``max_in_flight``, -1 none; the backend's and the candidate's slot
#: groups): the decider's view may lag what Redis holds; one that does not fit stays waiting
#: (``full``).
#: {gw, lease, ttl, init, live, upto, pools: [names], g: [[m, backend, pool], ...], seen: [lease keys],
#:  own: {pool: {c: [candidate], p: [[m, cost, guess]], w: [m], rel: [{m, keys, tok}]}}, plim: {pool: n},
#:  slices: the gateways' shares table (JSON) to keep in ``P slices`` | null, leads: the decider's
#:  meters' leads (JSON, ``Alone.leads``) to keep in ``P leads`` for the next decider | null}
#: -> JSON {ok: false, lead} | {ok: true, gone: [m], full: [candidate JSON], mine: [[m, backend, keys]]
#:          (its own gateway's grants), ev: [event JSON], cand: [candidate JSON], run: [[m, run JSON]],
#:          lc: [live candidates], lr: [live running], q, gw: [live gateways], leads (with init),
#:          lv (with ``leads``: their version, ``P leadsv``)}
DECIDE = _COMMON + r"""
local lk = P .. 'lead'
local lead = redis.call('GET', lk)
if (lead and lead ~= A.gw) or (not lead and not A.init) then
  return cjson.encode({ok = false, lead = lead or ''})
end
redis.call('SET', lk, A.gw, 'PX', math.ceil(A.ttl * 1000))
local cexp, run = P .. 'cexp', P .. 'run'
local function has(x) return x ~= nil and x ~= cjson.null end
local gone, owners, mine = {}, {}, {}
local exp = NOW + A.lease
-- the decider's own gateway's items (its queues have them already): releases, withdrawals,
-- new candidates, new prices, as OFFER writes another gateway's, without events
local freed = false
if has(A.own) then
  for pool, o in pairs(A.own) do
    local cand = P .. 'cand:' .. pool
    for _, r in ipairs(o.rel or {}) do
      release(r)
      freed = true
    end
    for _, m in ipairs(o.w or {}) do withdraw(cand, m) end
    for _, c in ipairs(o.c or {}) do queue(cand, c) end
    for _, x in ipairs(o.p or {}) do reprice(cand, x) end
  end
end
-- whether a start on backend b fits every limit the leases count (the decider's view is behind
-- what Redis holds: a running attempt put back, a release of its own applied before others'
-- events): else it is not made (``full``) and the decider waits for what it has not seen
local function fits(c, b, pool)
  local pl = A.plim and A.plim[pool]
  if pl and pl >= 0 and count(P .. 'lease:pool:' .. pool) >= pl then return false end
  for i, n in ipairs(c.backends or {}) do
    if n == b and count(P .. 'lease:backend:' .. b) >= (c.lims[i] or 0) then return false end
  end
  for _, x in ipairs(c.groups or {}) do
    if count(x[1]) >= x[2] then return false end
  end
  return true
end
local full = {}
for _, x in ipairs(A.g or {}) do
  local m, b, cand = x[1], x[2], P .. 'cand:' .. x[3]
  local cj = redis.call('HGET', cand, m)
  local c = cj and cjson.decode(cj)
  if not cj then
    gone[#gone + 1] = m
  elseif not fits(c, b, x[3]) then
    full[#full + 1] = cj
  else
    redis.call('HDEL', cand, m)
    redis.call('ZREM', cexp, m)
    local keys = {P .. 'lease:pool:' .. c.pool, P .. 'lease:backend:' .. b}
    for _, k in ipairs(c.groups or {}) do keys[#keys + 1] = k[1] end
    for _, k in ipairs(keys) do redis.call('ZADD', k, exp, m) end
    redis.call('HSET', run, m, cjson.encode({pool = c.pool, flow = c.flow, b = b}))
    if has(c.q) then redis.call('ZREM', c.q[1], c.q[2]) end
    if has(c.first) then
      redis.call('ZADD', c.first, NOW, m)
      redis.call('PEXPIRE', c.first, 61000)
    end
    local owner = string.match(m, '^([^:]+):')
    if owner == A.gw then  -- (its own: in the answer)
      mine[#mine + 1] = {m, b, keys}
      freed = true
    else
      local gj = cjson.encode({b = b, k = keys})
      redis.call('HSET', P .. 'grant:' .. owner, m, gj)
      redis.call('PEXPIRE', P .. 'grant:' .. owner, math.ceil(A.lease * 3000))
      owners[owner] = owners[owner] or {}
      local o = owners[owner]
      o[#o + 1] = {m, b, keys}
    end
  end
end
for o, gs in pairs(owners) do redis.call('PUBLISH', P .. 'wake', 'g:' .. o .. '\n' .. cjson.encode(gs)) end
if (freed or next(owners) ~= nil) and #(A.seen or {}) > 0 then  -- the slots held now, to every gateway (OFFER's)
  local ns = {}
  for _, k in ipairs(A.seen) do ns[#ns + 1] = {k, count(k)} end
  for _, p in ipairs(A.pools) do ns[#ns + 1] = {P .. 'cand:' .. p, redis.call('HLEN', P .. 'cand:' .. p)} end
  redis.call('PUBLISH', P .. 'wake', 'n\n' .. cjson.encode(ns))
end
local out = {ok = true, gone = gone, full = full, mine = mine, ev = {}, cand = {}, run = {}, lc = {}, lr = {}, q = 0, gw = {}}
if has(A.slices) then redis.call('SET', P .. 'slices', A.slices, 'PX', math.ceil(A.lease * 3000)) end
if has(A.leads) then
  out.lv = fmt(NOW)  -- (the decider keeps what it wrote: its renewals need not bring it back)
  redis.call('SET', P .. 'leads', A.leads, 'PX', math.ceil(A.lease * 3000))
  redis.call('SET', P .. 'leadsv', out.lv, 'PX', math.ceil(A.lease * 3000))
end
if A.init or A.live then
  out.gw = redis.call('ZRANGEBYSCORE', P .. 'gw', '(' .. fmt(NOW), '+inf')
  -- candidates whose gateway stopped renewing them leave; so do attempts whose leases expired
  local stale = redis.call('ZRANGEBYSCORE', cexp, '-inf', NOW)
  for _, p in ipairs(A.pools) do
    for _, m in ipairs(stale) do redis.call('HDEL', P .. 'cand:' .. p, m) end
  end
  redis.call('ZREMRANGEBYSCORE', cexp, '-inf', NOW)
  local live = {}
  for _, p in ipairs(A.pools) do
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', P .. 'lease:pool:' .. p, '(' .. fmt(NOW), '+inf')) do
      live[m] = true
    end
  end
  local rs = redis.call('HGETALL', run)
  for i = 1, #rs, 2 do
    if live[rs[i]] then
      out.lr[#out.lr + 1] = rs[i]
      if A.init then out.run[#out.run + 1] = {rs[i], rs[i + 1]} end
    else
      redis.call('HDEL', run, rs[i])
    end
  end
  out.lc = redis.call('ZRANGE', cexp, 0, -1)
end
if A.init then  -- the events so far are in the candidates and attempts taken now
  out.q = tonumber(redis.call('GET', P .. 'evq') or '0')
  out.leads = redis.call('GET', P .. 'leads') or ''
  redis.call('ZREMRANGEBYSCORE', P .. 'ev', '-inf', out.q)
  for _, p in ipairs(A.pools) do
    for _, c in ipairs(redis.call('HVALS', P .. 'cand:' .. p)) do out.cand[#out.cand + 1] = c end
  end
else
  -- the decider has every event up to A.upto (from the messages): those after, it has not
  redis.call('ZREMRANGEBYSCORE', P .. 'ev', '-inf', A.upto)
  out.ev = redis.call('ZRANGEBYSCORE', P .. 'ev', '(' .. A.upto, '+inf')
end
return cjson.encode(out)
"""

#: a waiting place leaves without a grant: {q: [key, member]}
WITHDRAW = _COMMON + r"""
if A.q ~= cjson.null and A.q ~= nil then redis.call('ZREM', A.q[1], A.q[2]) end
return {1}
"""

#: a retry, within the flow's budget over every gateway: at most ``pct`` percent of the flow's
#: attempts over the last minute are retries, but one retry waiting or running is always
#: allowed. {first, retry, out: keys, pct, lease, m} -> {1} (counted, and ``m`` holds one of
#: the flow's outstanding retries, a lease) | {0}
RETRY = _COMMON + r"""
local cut = NOW - 60
redis.call('ZREMRANGEBYSCORE', A.first, '-inf', cut)
redis.call('ZREMRANGEBYSCORE', A.retry, '-inf', cut)
local nf, nr = redis.call('ZCARD', A.first), redis.call('ZCARD', A.retry)
if count(A.out) > 0 and (nr + 1) * 100 > A.pct * (nf + nr + 1) then return {0} end
redis.call('ZADD', A.retry, NOW, A.m)
redis.call('PEXPIRE', A.retry, 61000)
redis.call('ZADD', A.out, NOW + A.lease, A.m)
return {1}
"""

#: every lease, candidate and waiting place this gateway holds, renewed, and the policy's
#: hash; with ``gw``, also what ``GATEWAYS`` does (this gateway alive; the live ones and the
#: decider's table and leads, JSON, else ''): {lease, hash, add, gw | null, lv, items: [[key, m], ...],
#: runs: [[m, run JSON], ...]} -> {1, the live gateways' JSON or '', missing indexes...} | {0,
#: the hash in force}. Without ``add`` only what Redis still has is renewed and the missing
#: ones are named; with ``add`` they are put back (Redis restarted empty: they are real).
RENEW = _COMMON + r"""
local cur = redis.call('GET', P .. 'policy')
if cur and cur ~= A.hash then return {0, cur} end
redis.call('SET', P .. 'policy', A.hash, 'PX', math.ceil(A.lease * 3000))
local exp = NOW + A.lease
local out = {1, (A.gw ~= nil and A.gw ~= cjson.null) and alive() or ''}
for i, it in ipairs(A.items) do
  local k = it[1]
  if A.add or redis.call('ZSCORE', k, it[2]) then
    redis.call('ZADD', k, exp, it[2])
  else
    out[#out + 1] = i - 1
  end
end
local evs = {}
for _, x in ipairs(A.runs or {}) do  -- (with add) the attempts running: the decider adopts them
  if redis.call('HSETNX', P .. 'run', x[1], x[2]) == 1 then
    local q = redis.call('INCR', P .. 'evq')
    local j = cjson.encode({t = 'u', m = x[1], run = x[2], q = q})
    redis.call('ZADD', P .. 'ev', q, j)
    evs[#evs + 1] = j
  end
end
if #evs > 0 then redis.call('PUBLISH', P .. 'wake', 'e\n[' .. table.concat(evs, ',') .. ']') end
return out
"""

#: a gateway joins: {lease, hash, force} -> {1} | {0, the hash in force}; ``force``: a reload
#: puts a new policy in force for the prefix (the gateways still on the old one then refuse
#: requests until they are reloaded too)
HELLO = _COMMON + r"""
local cur = redis.call('GET', P .. 'policy')
if cur and cur ~= A.hash and not A.force then return {0, cur} end
redis.call('SET', P .. 'policy', A.hash, 'PX', math.ceil(A.lease * 3000))
return {1}
"""

#: a gateway is alive (it joined or renewed): {gw, lease, lv} -> JSON {ids: the live gateways'
#: ids, sorted; table: the decider's last table of their shares while Redis would be lost (``P
#: slices``, JSON), or ''; lv, leads: when the decider last wrote its meters' leads and they
#: (``P leadsv``, ``P leads``), only when ``lv`` (the caller's) is not that}
GATEWAYS = _COMMON + r"""
return alive()
"""

#: a reservation in one or more budgets (an org's, its team's), all or none, atomic over every
#: gateway: in each, spent + live reservations + this one must stay within its limit.
#: {ks: [[spend key, limit], ...], m, a (amount), lease, keep (seconds)}
#: -> JSON {refused: [indexes of the budgets that cannot cover it], left: [limit - spent - held, ...]}
SPEND_RESERVE = _COMMON + r"""
local refused, left = {}, {}
for i, x in ipairs(A.ks) do
  local k, lim = x[1], x[2]
  local zk, ak = k .. ':res', k .. ':amt'
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', zk, '-inf', NOW)) do redis.call('HDEL', ak, m) end
  redis.call('ZREMRANGEBYSCORE', zk, '-inf', NOW)
  local spent = tonumber(redis.call('HGET', k, 's') or '0')
  local held = 0
  for _, m in ipairs(redis.call('ZRANGE', zk, 0, -1)) do held = held + tonumber(redis.call('HGET', ak, m) or '0') end
  left[#left + 1] = lim - spent - held
  if spent + held + A.a > lim or (A.a <= 0 and spent + held >= lim) then refused[#refused + 1] = i - 1 end
end
if #refused == 0 then
  for _, x in ipairs(A.ks) do
    local k = x[1]
    local zk, ak = k .. ':res', k .. ':amt'
    redis.call('ZADD', zk, NOW + A.lease, A.m)
    redis.call('HSET', ak, A.m, fmt(A.a))
    for _, kk in ipairs({k, zk, ak}) do redis.call('EXPIRE', kk, A.keep) end
  end
end
return cjson.encode({refused = refused, left = left})
"""

#: a reservation becomes what the request spent, in each budget it was held in: {ks: [spend
#: keys], m, s (currency), keep} -> {1}
SPEND_SETTLE = _COMMON + r"""
for _, k in ipairs(A.ks) do
  redis.call('ZREM', k .. ':res', A.m)
  redis.call('HDEL', k .. ':amt', A.m)
  if A.s > 0 then redis.call('HINCRBYFLOAT', k, 's', fmt(A.s)) end
  redis.call('EXPIRE', k, A.keep)
end
return {1}
"""
