"""The Lua scripts that change the shared state in Redis, each atomically in one round trip.

Every time in them is Redis's own (``TIME``): a lease's expiry, a bucket's refill and a
candidate's staleness never depend on a gateway's clock. Each script takes ``ARGV[1]`` (the
key prefix) and ``ARGV[2]`` (a JSON payload) and builds its keys from the prefix: the state
needs one Redis server (or a primary), not a Redis Cluster.

Keys (``P`` = the prefix):

* ``P lease:<kind>:<name>`` sorted set: a slot held (``<gateway>:<request>``) scored by its
  expiry; ``kind`` is ``pool``, ``backend``, ``org`` or ``class``.
* ``P bucket:<name>`` hash ``l`` (level), ``t`` (time): a token bucket; absent = full.
* ``P cand:<pool>`` sorted set: each waiting candidate's start tag; ``P cexp:<pool>`` its
  expiry; ``P cmeta:<pool>`` hash: what the order needs to know of it (JSON).
* ``P vt:<pool>``, ``P fmax:<pool>``, ``P fin:<pool>`` (hash flow -> finish tag): the SFQ
  virtual time and the flows' meters.
* ``P queue:<pool>:<class>`` sorted set: the class's waiting requests (max_queue_length).
* ``P rb:first|retry:<flow>`` sorted sets: the flow's first attempts and retries over the
  last minute; ``P rb:out:<flow>``: its retries waiting or running (leases): the retry budget.
* ``P seq``: the order of arrival of strict classes' candidates; ``P wake``: the pub/sub
  channel that tells the other gateways to look again (a slot freed, a turn passed).
* ``P policy``: the hash of the policy in force (expires unless a gateway renews it).
"""

from __future__ import annotations

__all__ = ["ADMIT", "ACQUIRE", "RENEW", "RETRY", "WITHDRAW", "HELLO"]

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

#: {m, lease, q: [key, max] | null, org: [key, cap, rate] | null} -> {1} | {0, reason, wait}
ADMIT = _COMMON + r"""
if A.q ~= cjson.null and A.q ~= nil then
  if count(A.q[1]) >= A.q[2] then return {0, 'queue_full', '1'} end
end
if A.org ~= cjson.null and A.org ~= nil then
  local key, cap, rate = A.org[1], A.org[2], A.org[3]
  local l = level(key, cap, rate)
  if l < 1 - 1e-9 then return {0, 'rate_limited', fmt((1 - l) / rate)} end
  bset(key, l - 1, cap, rate)
end
if A.q ~= cjson.null and A.q ~= nil then
  redis.call('ZADD', A.q[1], NOW + A.lease, A.m)
end
return {1}
"""

#: a gateway's candidates of one pool, in one round trip: register those not known (a start
#: tag from the flow's meter and the virtual time), then, in the global order, grant each one
#: while every limit has room and no candidate ahead of it (smaller tag, not stale, from any
#: gateway) could go instead.
#: Releases of the pool's slots this gateway's attempts held (``rel``) go first, in the same
#: round trip: a slot freed here goes straight to the next in the global order.
#: {pool, lease, pool_lim (or -1), rpm: [key, cap, rate] | null, tpm: [key, cap, rate] | null,
#:  rel: [{m, keys: [lease keys], diff (a usage correction of the tokens bucket)}, ...],
#:  c: [{m, flow, cost, w, strict (rank or -1), backends: [[name, lim], ...],
#:       groups: [[key, lim], ...], tokens, q: [key, member] | null,
#:       first: key | null (a first attempt: counted in its flow's retry-budget window)}
#:       or just {m} for a candidate registered by an earlier call, ...]}
#: -> {why the rest wait ('' | pool | bucket | order | group | backend), seconds (a bucket's
#:     wait), the number granted, member, backend, ..., then the members Redis no longer knew
#:     (sent as just {m}; the gateway sends them whole again)}
ACQUIRE = _COMMON + r"""
local pool = A.pool
local cand, cexp, cmeta = P .. 'cand:' .. pool, P .. 'cexp:' .. pool, P .. 'cmeta:' .. pool
local vtk, fmk, fink = P .. 'vt:' .. pool, P .. 'fmax:' .. pool, P .. 'fin:' .. pool
local plk = P .. 'lease:pool:' .. pool
local function has(x) return x ~= nil and x ~= cjson.null end
-- stale candidates (their gateway stopped renewing) leave the order
local stale = redis.call('ZRANGEBYSCORE', cexp, '-inf', NOW)
for _, s in ipairs(stale) do
  redis.call('ZREM', cand, s)
  redis.call('HDEL', cmeta, s)
end
if #stale > 0 then redis.call('ZREMRANGEBYSCORE', cexp, '-inf', NOW) end
local released = 0
for _, r in ipairs(A.rel or {}) do
  for _, k in ipairs(r.keys) do redis.call('ZREM', k, r.m) end
  if has(A.tpm) and r.diff ~= 0 then
    bset(A.tpm[1], level(A.tpm[1], A.tpm[2], A.tpm[3]) - r.diff, A.tpm[2], A.tpm[3])
  end
  released = released + 1
end
local inpool = count(plk)
local ncand = redis.call('ZCARD', cand)
local cs, lost = {}, {}
for _, c in ipairs(A.c) do
  local tag = redis.call('ZSCORE', cand, c.m)
  if c.flow == nil then  -- registered by an earlier call: its details are in cmeta
    local meta = tag and redis.call('HGET', cmeta, c.m)
    if meta then
      local d = cjson.decode(meta)
      c.flow, c.groups, c.backends, c.tokens, c.q, c.first = d.flow, d.groups, d.backends, d.tokens, d.q, d.first
    else
      lost[#lost + 1] = c.m
      tag = nil
      c = nil
    end
  elseif not tag then
    local s, f = nil, nil
    if c.strict >= 0 then
      tag = -1e15 + c.strict * 1e12 + redis.call('INCR', P .. 'seq')
    else
      local v = tonumber(redis.call('GET', vtk) or '0')
      if ncand == 0 and inpool == 0 then
        v = math.max(v, tonumber(redis.call('GET', fmk) or '0'))  -- a new busy period starts level
        redis.call('SET', vtk, fmt(v))
      end
      s = math.max(v, tonumber(redis.call('HGET', fink, c.flow) or '0'))
      f = s + c.cost / c.w
      redis.call('HSET', fink, c.flow, fmt(f))
      if f > tonumber(redis.call('GET', fmk) or '0') then redis.call('SET', fmk, fmt(f)) end
      tag = s
    end
    redis.call('ZADD', cand, tag, c.m)
    redis.call('HSET', cmeta, c.m, cjson.encode({groups = c.groups, flow = c.flow, s = s and fmt(s), f = f and fmt(f),
                                                 backends = c.backends, tokens = c.tokens, q = c.q, first = c.first}))
    ncand = ncand + 1
  end
  if c then
    c.tag = tonumber(tag)
    redis.call('ZADD', cexp, NOW + A.lease, c.m)
    cs[#cs + 1] = c
  end
end
table.sort(cs, function(x, y) return x.tag < y.tag or (x.tag == y.tag and x.m < y.m) end)
local function room(groups)
  for _, g in ipairs(groups) do
    if count(P .. 'lease:' .. g[1]) >= g[2] then return false end
  end
  return true
end
local out = {}
local stop, stopwait = nil, '0'
local why = ''
local granted = 0
for _, c in ipairs(cs) do
  if not stop then
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
        else
          -- the order: a candidate ahead of this one that could go now goes first
          for _, o in ipairs(redis.call('ZRANGEBYSCORE', cand, '-inf', '(' .. fmt(c.tag))) do
            local meta = redis.call('HGET', cmeta, o)
            if not meta or room(cjson.decode(meta).groups) then stop = 'order' break end
          end
          if not stop then
            local exp = NOW + A.lease
            redis.call('ZADD', plk, exp, c.m)
            redis.call('ZADD', P .. 'lease:backend:' .. best, exp, c.m)
            for _, g in ipairs(c.groups) do redis.call('ZADD', P .. 'lease:' .. g[1], exp, c.m) end
            if has(A.rpm) then
              bset(A.rpm[1], level(A.rpm[1], A.rpm[2], A.rpm[3]) - 1, A.rpm[2], A.rpm[3])
            end
            if has(A.tpm) then
              bset(A.tpm[1], level(A.tpm[1], A.tpm[2], A.tpm[3]) - c.tokens, A.tpm[2], A.tpm[3])
            end
            redis.call('ZREM', cand, c.m)
            redis.call('ZREM', cexp, c.m)
            redis.call('HDEL', cmeta, c.m)
            if has(c.q) then redis.call('ZREM', c.q[1], c.q[2]) end
            if has(c.first) then
              redis.call('ZADD', c.first, NOW, c.m)
              redis.call('PEXPIRE', c.first, 61000)
            end
            if c.tag >= 0 then
              local v = tonumber(redis.call('GET', vtk) or '0')
              if c.tag > v then redis.call('SET', vtk, fmt(c.tag)) end
            end
            inpool = inpool + 1
            granted = granted + 1
            out[#out + 1] = c.m
            out[#out + 1] = best
          end
        end
      end
    end
  end
end
if (granted > 0 or released > granted) and redis.call('ZCARD', cand) > 0 then
  redis.call('PUBLISH', P .. 'wake', pool)  -- someone waits: the others look again
end
local head = {stop or why, stopwait, granted}
for _, x in ipairs(out) do head[#head + 1] = x end
for _, m in ipairs(lost) do head[#head + 1] = m end
return head
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

#: a candidate (or a waiting request) leaves without a grant: {m, pool | null, q: [key, member] | null}
WITHDRAW = _COMMON + r"""
if A.pool ~= cjson.null and A.pool ~= nil then
  local cand, cexp, cmeta = P .. 'cand:' .. A.pool, P .. 'cexp:' .. A.pool, P .. 'cmeta:' .. A.pool
  local meta = redis.call('HGET', cmeta, A.m)
  if meta then
    local c = cjson.decode(meta)
    local fink = P .. 'fin:' .. A.pool
    if c.f ~= nil and c.f ~= cjson.null and redis.call('HGET', fink, c.flow) == c.f then
      redis.call('HSET', fink, c.flow, c.s)  -- uncharged: the flow's meter goes back
    end
  end
  redis.call('ZREM', cand, A.m)
  redis.call('ZREM', cexp, A.m)
  redis.call('HDEL', cmeta, A.m)
  if redis.call('ZCARD', cand) > 0 then redis.call('PUBLISH', P .. 'wake', A.pool) end
end
if A.q ~= cjson.null and A.q ~= nil then redis.call('ZREM', A.q[1], A.q[2]) end
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
