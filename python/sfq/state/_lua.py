"""The Lua scripts that change the shared state in Redis, each atomically in one round trip.

Every time in them is Redis's own (``TIME``): a lease's expiry, a bucket's refill and a
candidate's staleness never depend on a gateway's clock. Each script takes ``ARGV[1]`` (the
key prefix) and ``ARGV[2]`` (a JSON payload) and builds its keys from the prefix: the state
needs one Redis server (or a primary), not a Redis Cluster.

Keys (``P`` = the prefix):

* ``P lease:<kind>:<name>`` sorted set: a slot held (``<gateway>:<request>``) scored by its
  expiry; ``kind`` is ``pool``, ``backend``, ``org`` or ``class``.
* ``P bucket:<name>`` hash ``l`` (level), ``t`` (time): a token bucket; absent = full.
* ``P fin:<pool>`` hash flow -> meter ``S``, ``P vt:<pool>`` the virtual time ``v``, ``P
  fmax:<pool>`` the largest finish tag: the engine's meters (cost units divided by weight),
  changed only by the engine's charges (at dispatch, as delivered, at settlement).
* ``P bl:<pool>`` sorted set: the backlogged flows (a candidate waiting at some gateway)
  scored by their meter; ``P cf:<pool>:<flow>`` sorted set: a flow's candidates by arrival;
  ``P fgroups:<pool>`` hash flow -> its slot groups; ``P scand:<pool>``: the strict classes'
  candidates (rank, then arrival); ``P cexp:<pool>`` every candidate's expiry; ``P
  cmeta:<pool>`` hash: what the order needs to know of each candidate (JSON).
* ``P lease:flow:<pool>:<flow>`` sorted set: the flow's attempts running (the delivered-service
  modes: a flow with work in flight keeps its meter when it rejoins); ``P floor:<pool>`` hash
  flow -> its refund floor (JSON), while it has one.
* ``P queue:<pool>:<class>`` sorted set: the class's waiting requests (max_queue_length),
  each member ending with a tab and its org.
* ``P rb:first|retry:<flow>`` sorted sets: the flow's first attempts and retries over the
  last minute; ``P rb:out:<flow>``: its retries waiting or running (leases): the retry budget.
* ``P seq``: the order of arrival of candidates; ``P wake``: the pub/sub channel that tells
  the other gateways to look again (a slot freed, a turn passed); ``P evict``: the channel
  that names a waiting place taken from the org holding the most (``ADMIT``).
* ``P gw`` sorted set: the live gateways (their ids, scored by the expiry of their last
  renewal): how many share each limit, and each one's rank, for the slices a gateway keeps
  while Redis cannot be reached.
* ``P policy``: the hash of the policy in force (expires unless a gateway renews it).
* ``P spend:<org>:<period>`` hash ``s``: what the org spent in the period (currency, settled
  requests); ``... :res`` sorted set: its running requests' reservations (leases, renewed by
  their gateway), ``... :amt`` hash member -> the reserved amount. They expire some days after
  the period ends.
"""

from __future__ import annotations

__all__ = ["ADMIT", "ACQUIRE", "RENEW", "RETRY", "WITHDRAW", "HELLO", "GATEWAYS", "SPEND_RESERVE", "SPEND_SETTLE"]

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
#: {m, o (the org), lease, q: [key, max] | null, org: [key, cap, rate] | null}
#: -> {1, the member evicted or ''} | {0, reason, wait}
ADMIT = _COMMON + r"""
local has_q = A.q ~= cjson.null and A.q ~= nil
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
if A.org ~= cjson.null and A.org ~= nil then
  local key, cap, rate = A.org[1], A.org[2], A.org[3]
  local l = level(key, cap, rate)
  if l < 1 - 1e-9 then return {0, 'rate_limited', fmt((1 - l) / rate)} end
  bset(key, l - 1, cap, rate)
end
if evict ~= '' then
  redis.call('ZREM', A.q[1], evict)
  redis.call('PUBLISH', P .. 'evict', evict)
end
if has_q then
  redis.call('ZADD', A.q[1], NOW + A.lease, A.m)
end
return {1, evict}
"""

#: The pool's part of the engine's ledger (docs/design.md, "The ledger"): meters, virtual
#: time, busy period, candidates. Shared by ACQUIRE and WITHDRAW.
_LEDGER = r"""
local pool = A.pool
local cexp, cmeta = P .. 'cexp:' .. pool, P .. 'cmeta:' .. pool
local bl, sc = P .. 'bl:' .. pool, P .. 'scand:' .. pool
local fink, vtk, fmk, fgk = P .. 'fin:' .. pool, P .. 'vt:' .. pool, P .. 'fmax:' .. pool, P .. 'fgroups:' .. pool
local plk = P .. 'lease:pool:' .. pool
local flo = P .. 'floor:' .. pool
local LEAD = 2199023255552  -- 2**41 cost units: how far a refund may take a running flow below v
local function has(x) return x ~= nil and x ~= cjson.null end
local function cfk(flow) return P .. 'cf:' .. pool .. ':' .. flow end
local function flk(flow) return P .. 'lease:flow:' .. pool .. ':' .. flow end
local function getn(k) return tonumber(redis.call('GET', k) or '0') end
local function meter(flow)
  local x = redis.call('HGET', fink, flow)
  return x and tonumber(x)
end
local function setmeter(flow, S)
  redis.call('HSET', fink, flow, fmt(S))
  if S > getn(fmk) then redis.call('SET', fmk, fmt(S)) end
  if redis.call('ZSCORE', bl, flow) then redis.call('ZADD', bl, S, flow) end
end
-- a candidate leaves the order (granted, withdrawn or stale); a flow with none left is no
-- longer backlogged
local function unregister(m, meta)
  redis.call('ZREM', cexp, m)
  redis.call('HDEL', cmeta, m)
  if not meta then return end
  if meta.strict >= 0 then
    redis.call('ZREM', sc, m)
    return
  end
  local k = cfk(meta.flow)
  redis.call('ZREM', k, m)
  if redis.call('ZCARD', k) == 0 then
    redis.call('ZREM', bl, meta.flow)
    redis.call('HDEL', fgk, meta.flow)
  end
end
-- the idle rule: nothing waits and nothing runs, so the next busy period starts level
-- (v = max(v, largest finish tag)); every meter is then at or below v and is forgotten
local function idle()
  if redis.call('ZCARD', bl) == 0 and redis.call('ZCARD', sc) == 0 and count(plk) == 0 then
    local v, fm = getn(vtk), getn(fmk)
    if fm > v then redis.call('SET', vtk, fmt(fm)) end
    redis.call('DEL', fink, flo)
  end
end
-- the refund floors (the engine's sfq.engine._floors, docs/design.md 4): a flow whose grant set
-- v while it alone was backlogged is not refunded, for the work it had in flight then, below
-- that start tag plus what its attempts granted since were charged. {s, b (cost units of those
-- that ended), i: member -> cost units charged}
local function getfloor(flow)
  local x = redis.call('HGET', flo, flow)
  return x and cjson.decode(x)
end
local function putfloor(flow, fl)
  fl.i['_'] = nil
  if next(fl.i) == nil then
    if count(flk(flow)) == 0 then
      redis.call('HDEL', flo, flow)
      return
    end
    fl.i['_'] = 0  -- (cjson writes an empty table as a list; '_' is no member)
  end
  redis.call('HSET', flo, flow, cjson.encode(fl))
end
local function decode(m)
  local meta = redis.call('HGET', cmeta, m)
  return meta and cjson.decode(meta)
end
-- stale candidates (their gateway stopped renewing) leave the order
local stale = redis.call('ZRANGEBYSCORE', cexp, '-inf', NOW)
for _, s in ipairs(stale) do unregister(s, decode(s)) end
"""

#: A gateway's round trip for one pool: the engine's corrections of its flows' meters
#: (``adj``), the slots its attempts give back (``rel``), then its candidates: those not
#: known yet join the order (a flow that was not backlogged rejoins at ``S = max(S, v)``, or
#: keeps its meter while work of it runs: the engine's rule), and each, smallest start tag
#: first, is granted while every limit has room and no candidate of any gateway ahead of it
#: could go instead. A grant charges the flow ``cost / weight`` (the engine's charge at
#: dispatch) and sets ``v`` to the flow's start tag, as the engine's core does.
#: {pool, lease, pool_lim (or -1), rpm: [key, cap, rate] | null, tpm: [key, cap, rate] | null,
#:  bk: [the pool's backends' names],
#:  adj: [[flow, delta (cost units), weight, member (the attempt)], ...],
#:  rel: [{m, keys: [lease keys], diff (a usage correction of the tokens bucket),
#:         flow (when it held a flow lease)}, ...],
#:  c: [{m, flow, cost, w, wf (its work is the flow's: it holds a flow lease), guess (its cost is an
#:       estimate its flow's own calibration did not price), strict (rank or -1),
#:       backends: [[name, lim], ...], groups: [[key, lim], ...], tokens, q: [key, member] | null,
#:       first: key | null (a first attempt: counted in its flow's retry-budget window)}
#:       or just {m} for a candidate registered by an earlier call, or {m, cost, guess} for one its
#:       gateway priced again (the engine's calibration moved while it waited: the grant charges
#:       the price as calibrated at the grant, as one engine charges at dispatch), ...]}
#: -> {why the rest wait ('' | pool | bucket | order | group | backend), seconds (a bucket's
#:     wait), the number granted, k (1 + the number of backends), the slots the pool holds
#:     now, those each backend of ``bk`` holds, then member, backend, ... (the grants), then
#:     the members Redis no longer knew (sent as just {m}; the gateway sends them whole again)}
ACQUIRE = _COMMON + _LEDGER + r"""
-- the engine's corrections first (they happened while the attempts ran), then the releases
for _, a in ipairs(A.adj or {}) do
  local flow, d, w, m = a[1], a[2], a[3], a[4]
  local v, S = getn(vtk), meter(flow)
  local fl = getfloor(flow)
  local new
  if S and count(flk(flow)) > 0 then  -- work in flight: its meter (lag included) is its own
    new = math.max(S + d / w, v - LEAD)
    if fl and d < 0 and fl.i[m] == nil then  -- a refund of work in flight when it set v alone
      local sum = fl.b
      for k, x in pairs(fl.i) do if k ~= '_' then sum = sum + x end end
      new = math.max(new, math.min(S, fl.s + sum / w))
    end
  else
    new = math.max(math.max(S or v, v) + d / w, v)
  end
  if fl and fl.i[m] ~= nil then
    fl.i[m] = fl.i[m] + (new - (S or v)) * w
    putfloor(flow, fl)
  end
  if S or new > v then setmeter(flow, new) end
end
local released = 0
for _, r in ipairs(A.rel or {}) do
  for _, k in ipairs(r.keys) do redis.call('ZREM', k, r.m) end
  local fl = has(r.flow) and getfloor(r.flow)
  if fl then
    if fl.i[r.m] ~= nil then
      fl.b = fl.b + fl.i[r.m]
      fl.i[r.m] = nil
    end
    putfloor(r.flow, fl)
  end
  if has(A.tpm) and r.diff ~= 0 then
    bset(A.tpm[1], level(A.tpm[1], A.tpm[2], A.tpm[3]) - r.diff, A.tpm[2], A.tpm[3])
  end
  released = released + 1
end
idle()
local cs, lost = {}, {}
for _, c in ipairs(A.c) do
  local meta = decode(c.m)
  if meta then
    if c.cost ~= nil and (c.cost ~= meta.cost or c.guess ~= meta.guess) then  -- priced again: the grant charges this
      meta.cost, meta.guess = c.cost, c.guess
      redis.call('HSET', cmeta, c.m, cjson.encode(meta))
    end
    meta.m = c.m
    c = meta
  elseif c.flow == nil then  -- registered by an earlier call, and Redis no longer knows it
    lost[#lost + 1] = c.m
    c = nil
  else
    c.seq = redis.call('INCR', P .. 'seq')
    if c.strict >= 0 then
      redis.call('ZADD', sc, c.strict * 1e12 + c.seq, c.m)
    else
      if not redis.call('ZSCORE', bl, c.flow) then  -- the flow (re)joins
        local v, S = getn(vtk), meter(c.flow)
        if not S then
          S = v
        elseif S < v and count(flk(c.flow)) == 0 then
          S = v  -- no banking while away
        end
        redis.call('HSET', fink, c.flow, fmt(S))
        redis.call('ZADD', bl, S, c.flow)
        redis.call('HSET', fgk, c.flow, cjson.encode(c.groups))
      end
      redis.call('ZADD', cfk(c.flow), c.seq, c.m)
    end
    redis.call('HSET', cmeta, c.m, cjson.encode(c))
  end
  if c then
    redis.call('ZADD', cexp, NOW + A.lease, c.m)
    cs[#cs + 1] = c
  end
end
local function room(groups)
  for _, g in ipairs(groups) do
    if count(P .. 'lease:' .. g[1]) >= g[2] then return false end
  end
  return true
end
-- the order key of a candidate: strict classes first (rank, then arrival), then the weighted
-- flows by start tag (the flow's meter), ties to the flow whose candidate came first
local function key(c)
  if c.strict >= 0 then
    c.k1, c.k2, c.k3 = 0, c.strict * 1e12 + c.seq, 0
  else
    c.k1, c.k2, c.k3 = 1, tonumber(redis.call('ZSCORE', bl, c.flow)), c.seq
  end
end
for _, c in ipairs(cs) do key(c) end
local function before(a1, a2, a3, b1, b2, b3)
  return a1 < b1 or (a1 == b1 and (a2 < b2 or (a2 == b2 and a3 < b3)))
end
-- whether a candidate of another flow (any gateway's) ahead of key (k1, k2, k3) could go now
local function ahead(k1, k2, k3, flow)
  for _, o in ipairs(redis.call('ZRANGEBYSCORE', sc, '-inf', k1 == 0 and '(' .. fmt(k2) or '+inf')) do
    local meta = decode(o)
    if not meta or room(meta.groups) then return true end
  end
  if k1 == 0 then return false end
  local fl = redis.call('ZRANGEBYSCORE', bl, '-inf', fmt(k2), 'WITHSCORES')
  for i = 1, #fl, 2 do
    local f, s = fl[i], tonumber(fl[i + 1])
    if f ~= flow then
      local go = s < k2
      if not go then
        local h = redis.call('ZRANGE', cfk(f), 0, 0, 'WITHSCORES')
        go = h[2] ~= nil and tonumber(h[2]) < k3
      end
      if go then
        local g = redis.call('HGET', fgk, f)
        if not g or room(cjson.decode(g)) then return true end
      end
    end
  end
  return false
end
local inpool = count(plk)
local out = {}
local stop, stopwait = nil, '0'
local why = ''
local granted = 0
local done = {}
while not stop do
  local c, c1, c2, c3 = nil, nil, nil, nil
  for _, x in ipairs(cs) do
    if not done[x.m] and x.k2 and (c == nil or before(x.k1, x.k2, x.k3, c1, c2, c3)) then
      c, c1, c2, c3 = x, x.k1, x.k2, x.k3
    end
  end
  if c == nil then break end
  done[c.m] = true
  if A.pool_lim >= 0 and inpool >= A.pool_lim then
    stop = 'pool'
  elseif has(A.rpm) and level(A.rpm[1], A.rpm[2], A.rpm[3]) < 1 - 1e-9 then
    stop, stopwait = 'bucket', fmt((1 - level(A.rpm[1], A.rpm[2], A.rpm[3])) / A.rpm[3])
  elseif not room(c.groups) then
    if why == '' then why = 'group' end
  else
    local need = 0
    if has(A.tpm) then need = math.min(c.tokens, A.tpm[2]) end
    local tl = has(A.tpm) and level(A.tpm[1], A.tpm[2], A.tpm[3]) or 0
    if has(A.tpm) and tl < need - 1e-9 then
      stop, stopwait = 'bucket', fmt((need - tl) / A.tpm[3])
    else
      local best, load = nil, 2
      for _, b in ipairs(c.backends) do
        local n = count(P .. 'lease:backend:' .. b[1])
        if n < b[2] and n / b[2] < load then best, load = b[1], n / b[2] end
      end
      if best == nil then
        if why == '' then why = 'backend' end
      elseif ahead(c1, c2, c3, c.flow) then
        stop = 'order'
      else
        local exp = NOW + A.lease
        redis.call('ZADD', plk, exp, c.m)
        redis.call('ZADD', P .. 'lease:backend:' .. best, exp, c.m)
        for _, g in ipairs(c.groups) do redis.call('ZADD', P .. 'lease:' .. g[1], exp, c.m) end
        if c.strict < 0 then
          -- the charge at dispatch: v moves to the flow's start tag, the meter by cost / weight
          local v0 = getn(vtk)
          local S = meter(c.flow) or v0
          if S > v0 then redis.call('SET', vtk, fmt(S)) end
          setmeter(c.flow, S + c.cost / c.w)
          if c.wf then
            redis.call('ZADD', flk(c.flow), exp, c.m)
            local fl = getfloor(c.flow)
            if c.guess and S > v0 and redis.call('ZCARD', bl) == 1 then  -- it sets v alone, on a guess
              fl = {s = S, b = 0, i = {}}
            end
            if fl then
              fl.i[c.m] = c.cost
              putfloor(c.flow, fl)
            end
          end
        end
        if has(A.rpm) then
          bset(A.rpm[1], level(A.rpm[1], A.rpm[2], A.rpm[3]) - 1, A.rpm[2], A.rpm[3])
        end
        if has(A.tpm) then
          bset(A.tpm[1], level(A.tpm[1], A.tpm[2], A.tpm[3]) - c.tokens, A.tpm[2], A.tpm[3])
        end
        unregister(c.m, c)
        if c.strict < 0 then  -- the flow's other candidates here: their start tag moved
          for _, x in ipairs(cs) do
            if not done[x.m] and x.flow == c.flow and x.strict < 0 then key(x) end
          end
        end
        if has(c.q) then redis.call('ZREM', c.q[1], c.q[2]) end
        if has(c.first) then
          redis.call('ZADD', c.first, NOW, c.m)
          redis.call('PEXPIRE', c.first, 61000)
        end
        inpool = inpool + 1
        granted = granted + 1
        out[#out + 1] = c.m
        out[#out + 1] = best
      end
    end
  end
end
if (granted > 0 or released > 0) and redis.call('ZCARD', cexp) > 0 then
  redis.call('PUBLISH', P .. 'wake', pool)  -- someone waits: the others look again
end
-- what the pool and its backends hold now, over every gateway (what is left of each limit,
-- should Redis be lost before the next call: docs/gateway.md, "When Redis is lost")
local head = {stop or why, stopwait, granted, 1 + #(A.bk or {}), inpool}
for _, b in ipairs(A.bk or {}) do head[#head + 1] = count(P .. 'lease:backend:' .. b) end
for _, x in ipairs(out) do head[#head + 1] = x end
for _, m in ipairs(lost) do head[#head + 1] = m end
return head
"""

#: a candidate (or a waiting place) leaves without a grant: {m, pool | null, q: [key, member] | null}.
#: Nothing was charged for it (a flow is charged when its candidate is granted).
WITHDRAW = _COMMON + r"""
if A.q ~= cjson.null and A.q ~= nil then redis.call('ZREM', A.q[1], A.q[2]) end
if A.pool == cjson.null or A.pool == nil then return {1} end
""" + _LEDGER + r"""
unregister(A.m, decode(A.m))
idle()
if redis.call('ZCARD', cexp) > 0 then redis.call('PUBLISH', P .. 'wake', pool) end
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
#: hash: {lease, hash, add, items: [[key, m], ...]} -> {1, missing indexes...} | {0, the hash
#: in force}. Without ``add`` only what Redis still has is renewed and the missing ones are
#: named; with ``add`` they are put back (Redis restarted empty: they are real).
RENEW = _COMMON + r"""
local cur = redis.call('GET', P .. 'policy')
if cur and cur ~= A.hash then return {0, cur} end
redis.call('SET', P .. 'policy', A.hash, 'PX', math.ceil(A.lease * 3000))
local exp = NOW + A.lease
local out = {1}
for i, it in ipairs(A.items) do
  local k = it[1]
  if A.add or redis.call('ZSCORE', k, it[2]) then
    redis.call('ZADD', k, exp, it[2])
  else
    out[#out + 1] = i - 1
  end
end
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

#: a gateway is alive (it joined or renewed): {gw, lease} -> the live gateways' ids, sorted
GATEWAYS = _COMMON + r"""
local k = P .. 'gw'
redis.call('ZREMRANGEBYSCORE', k, '-inf', NOW)
redis.call('ZADD', k, NOW + A.lease, A.gw)
redis.call('PEXPIRE', k, math.ceil(A.lease * 3000))
return redis.call('ZRANGE', k, 0, -1)
"""

#: a budget's reservation, atomic over every gateway: spent + live reservations + this one must
#: stay within the limit. {k (the spend key), m, a (amount), lim, lease, keep (seconds)}
#: -> {1 | 0, spent, reserved}
SPEND_RESERVE = _COMMON + r"""
local zk, ak = A.k .. ':res', A.k .. ':amt'
for _, m in ipairs(redis.call('ZRANGEBYSCORE', zk, '-inf', NOW)) do redis.call('HDEL', ak, m) end
redis.call('ZREMRANGEBYSCORE', zk, '-inf', NOW)
local spent = tonumber(redis.call('HGET', A.k, 's') or '0')
local held = 0
for _, m in ipairs(redis.call('ZRANGE', zk, 0, -1)) do held = held + tonumber(redis.call('HGET', ak, m) or '0') end
if spent + held + A.a > A.lim or (A.a <= 0 and spent + held >= A.lim) then return {0, fmt(spent), fmt(held)} end
redis.call('ZADD', zk, NOW + A.lease, A.m)
redis.call('HSET', ak, A.m, fmt(A.a))
for _, k in ipairs({A.k, zk, ak}) do redis.call('EXPIRE', k, A.keep) end
return {1, fmt(spent), fmt(held)}
"""

#: a reservation becomes what the request spent: {k, m, s (currency), keep} -> {1}
SPEND_SETTLE = _COMMON + r"""
redis.call('ZREM', A.k .. ':res', A.m)
redis.call('HDEL', A.k .. ':amt', A.m)
if A.s > 0 then redis.call('HINCRBYFLOAT', A.k, 's', fmt(A.s)) end
redis.call('EXPIRE', A.k, A.keep)
return {1}
"""
