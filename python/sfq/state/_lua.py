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
* ``P policy``: the hash of the policy in force (expires unless a gateway renews it).
"""

from __future__ import annotations

__all__ = ["ADMIT", "ACQUIRE", "RELEASE", "RENEW", "WITHDRAW", "HELLO"]

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

#: one candidate's turn: register it if it is not known (its start tag from the flow's
#: meter and the virtual time), then grant it if every limit has room and no candidate
#: ahead of it (smaller tag, not stale) could go instead.
#: {m, pool, lease, flow, cost, w, strict (rank or -1), pool_lim (or -1), backends: [[name,
#:  lim], ...], groups: [[key, lim], ...], rpm: [key, cap, rate] | null, tpm: [key, cap, rate,
#:  tokens] | null, q: [key, member] | null}
#: -> {1, backend} | {0, reason, wait}
ACQUIRE = _COMMON + r"""
local pool = A.pool
local cand, cexp, cmeta = P .. 'cand:' .. pool, P .. 'cexp:' .. pool, P .. 'cmeta:' .. pool
local vtk, fmk, fink = P .. 'vt:' .. pool, P .. 'fmax:' .. pool, P .. 'fin:' .. pool
local plk = P .. 'lease:pool:' .. pool
-- stale candidates (their gateway stopped renewing) leave the order
local stale = redis.call('ZRANGEBYSCORE', cexp, '-inf', NOW)
for _, s in ipairs(stale) do
  redis.call('ZREM', cand, s)
  redis.call('HDEL', cmeta, s)
end
if #stale > 0 then redis.call('ZREMRANGEBYSCORE', cexp, '-inf', NOW) end
local inpool = count(plk)
local tag = redis.call('ZSCORE', cand, A.m)
if not tag then
  if A.strict >= 0 then
    tag = -1e15 + A.strict * 1e12 + redis.call('INCR', P .. 'seq')
  else
    local v = tonumber(redis.call('GET', vtk) or '0')
    if redis.call('ZCARD', cand) == 0 and inpool == 0 then
      v = math.max(v, tonumber(redis.call('GET', fmk) or '0'))  -- a new busy period starts level
      redis.call('SET', vtk, fmt(v))
    end
    local s = math.max(v, tonumber(redis.call('HGET', fink, A.flow) or '0'))
    local f = s + A.cost / A.w
    redis.call('HSET', fink, A.flow, fmt(f))
    if f > tonumber(redis.call('GET', fmk) or '0') then redis.call('SET', fmk, fmt(f)) end
    tag = s
    A.s = s
    A.f = f
  end
  redis.call('ZADD', cand, tag, A.m)
  redis.call('HSET', cmeta, A.m, cjson.encode({groups = A.groups, flow = A.flow, s = A.s and fmt(A.s), f = A.f and fmt(A.f)}))
end
tag = tonumber(tag)
redis.call('ZADD', cexp, NOW + A.lease, A.m)
-- limits shared by every candidate of the pool
if A.pool_lim >= 0 and inpool >= A.pool_lim then return {0, 'pool', '0'} end
if A.rpm ~= cjson.null and A.rpm ~= nil then
  local l = level(A.rpm[1], A.rpm[2], A.rpm[3])
  if l < 1 - 1e-9 then return {0, 'bucket', fmt((1 - l) / A.rpm[3])} end
end
-- this candidate's own limits
for _, g in ipairs(A.groups) do
  if count(P .. 'lease:' .. g[1]) >= g[2] then return {0, 'group', '0'} end
end
if A.tpm ~= cjson.null and A.tpm ~= nil then
  local need = math.min(A.tpm[4], A.tpm[2])
  local l = level(A.tpm[1], A.tpm[2], A.tpm[3])
  if l < need - 1e-9 then return {0, 'bucket', fmt((need - l) / A.tpm[3])} end
end
local best, load = nil, 2
for _, b in ipairs(A.backends) do
  local n = count(P .. 'lease:backend:' .. b[1])
  if n < b[2] and n / b[2] < load then best, load = b[1], n / b[2] end
end
if best == nil then return {0, 'backend', '0'} end
-- the order: a candidate ahead of this one that could go now goes first
local ahead = redis.call('ZRANGEBYSCORE', cand, '-inf', '(' .. fmt(tag))
for _, o in ipairs(ahead) do
  local meta = redis.call('HGET', cmeta, o)
  local ok = true
  if meta then
    for _, g in ipairs(cjson.decode(meta).groups) do
      if count(P .. 'lease:' .. g[1]) >= g[2] then ok = false break end
    end
  end
  if ok then return {0, 'order', '0'} end
end
-- granted
local exp = NOW + A.lease
redis.call('ZADD', plk, exp, A.m)
redis.call('ZADD', P .. 'lease:backend:' .. best, exp, A.m)
for _, g in ipairs(A.groups) do redis.call('ZADD', P .. 'lease:' .. g[1], exp, A.m) end
if A.rpm ~= cjson.null and A.rpm ~= nil then
  bset(A.rpm[1], level(A.rpm[1], A.rpm[2], A.rpm[3]) - 1, A.rpm[2], A.rpm[3])
end
if A.tpm ~= cjson.null and A.tpm ~= nil then
  bset(A.tpm[1], level(A.tpm[1], A.tpm[2], A.tpm[3]) - A.tpm[4], A.tpm[2], A.tpm[3])
end
redis.call('ZREM', cand, A.m)
redis.call('ZREM', cexp, A.m)
redis.call('HDEL', cmeta, A.m)
if A.q ~= cjson.null and A.q ~= nil then redis.call('ZREM', A.q[1], A.q[2]) end
if tag >= 0 then
  local v = tonumber(redis.call('GET', vtk) or '0')
  if tag > v then redis.call('SET', vtk, fmt(tag)) end
end
if redis.call('ZCARD', cand) > 0 then redis.call('PUBLISH', P .. 'wake', pool) end
return {1, best}
"""

#: a granted attempt ended: {m, pool, keys: [lease keys], tpm: [key, cap, rate, diff] | null}
RELEASE = _COMMON + r"""
for _, k in ipairs(A.keys) do redis.call('ZREM', k, A.m) end
if A.tpm ~= cjson.null and A.tpm ~= nil then
  local key, cap, rate, diff = A.tpm[1], A.tpm[2], A.tpm[3], A.tpm[4]
  bset(key, level(key, cap, rate) - diff, cap, rate)
end
redis.call('PUBLISH', P .. 'wake', A.pool)
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
  redis.call('PUBLISH', P .. 'wake', A.pool)
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

#: a gateway joins: {lease, hash} -> {1} | {0, the hash in force}
HELLO = _COMMON + r"""
local cur = redis.call('GET', P .. 'policy')
if cur and cur ~= A.hash then return {0, cur} end
redis.call('SET', P .. 'policy', A.hash, 'PX', math.ceil(A.lease * 3000))
return {1}
"""
