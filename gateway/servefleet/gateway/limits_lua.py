"""The Lua scripts that change the shared limits in Redis, each one atomic step on Redis' own
clock (so every gateway replica agrees on time), and the lease time of a concurrency slot."""

from __future__ import annotations

# A concurrency slot in Redis is a lease its gateway renews every third of this: a gateway that
# dies (SIGKILL, OOM, node lost) stops renewing, and its slots come back to the tenant within
# this time instead of being held until some long safety timeout.
REDIS_LEASE_TTL_S = 30.0

# KEYS: one live set per lease; ARGV: lease ttl ms, then the reservation id of each key.
# XX: a lease already settled or expired is not brought back.
RENEW_LUA = """
local ttl_ms = tonumber(ARGV[1])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now_ms + ttl_ms, ARGV[i + 1])
  redis.call('PEXPIRE', key, ttl_ms)
end
return #KEYS
"""

# KEYS: 3 per scope (requests bucket, tokens bucket, live set), then 1 per budget charged.
# ARGV: tokens, reservation id, lease ttl ms, number of scopes, then 3 per scope (rpm, tpm,
# concurrency; 0 = unlimited), then 3 per budget (limit, amount, seconds the counter lives).
# The clock is Redis' own TIME, so every gateway replica agrees on it. Nothing changes unless
# every window has room and every budget holds its whole charge. Returns the window refused
# (0: none) and its wait, 1 when a budget refused, then each scope's levels and each budget's
# used (after the charge when admitted).
RESERVE_LUA = """
local tokens = tonumber(ARGV[1])
local rid = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local nscopes = tonumber(ARGV[4])
local nbudgets = #KEYS - nscopes * 3
local bargs = 4 + nscopes * 3
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local levels = {}
local exceeded = 0
local wait = 0
local function level_of(key, cap)
  local v = redis.call('HMGET', key, 'l', 's')
  if not v[1] then return cap end
  local l = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60
  if l > cap then l = cap end
  return l
end
local function note(code, w)
  if exceeded == 0 or w > wait then
    if w > wait then wait = w end
    exceeded = code
  end
end
for i = 0, nscopes - 1 do
  local rpm = tonumber(ARGV[5 + i * 3])
  local tpm = tonumber(ARGV[6 + i * 3])
  local conc = tonumber(ARGV[7 + i * 3])
  local rl, tl = -1, -1
  if rpm > 0 then
    rl = level_of(KEYS[1 + i * 3], rpm)
    if rl < 1 then note(1, (1 - rl) * 60 / rpm) end
  end
  if tpm > 0 then
    tl = level_of(KEYS[2 + i * 3], tpm)
    if tl < tokens then note(2, (tokens - tl) * 60 / tpm) end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3 + i * 3], '-inf', now * 1000)
    if redis.call('ZCARD', KEYS[3 + i * 3]) >= conc then note(3, 1) end
  end
  levels[i + 1] = {rl, tl}
end
local used = {}
local broke = false
for j = 1, nbudgets do
  used[j] = tonumber(redis.call('GET', KEYS[nscopes * 3 + j]) or '0')
  if used[j] + tonumber(ARGV[bargs + j * 3 - 1]) > tonumber(ARGV[bargs + j * 3 - 2]) then
    broke = true
  end
end
if exceeded == 0 and not broke then
  for i = 0, nscopes - 1 do
    local rpm = tonumber(ARGV[5 + i * 3])
    local tpm = tonumber(ARGV[6 + i * 3])
    local conc = tonumber(ARGV[7 + i * 3])
    if rpm > 0 then
      levels[i + 1][1] = levels[i + 1][1] - 1
      redis.call('HSET', KEYS[1 + i * 3], 'l', levels[i + 1][1], 's', now)
      redis.call('EXPIRE', KEYS[1 + i * 3], 120)
    end
    if tpm > 0 then
      levels[i + 1][2] = levels[i + 1][2] - tokens
      redis.call('HSET', KEYS[2 + i * 3], 'l', levels[i + 1][2], 's', now)
      redis.call('EXPIRE', KEYS[2 + i * 3], 120)
    end
    if conc > 0 then
      redis.call('ZADD', KEYS[3 + i * 3], now * 1000 + ttl_ms, rid)
      redis.call('PEXPIRE', KEYS[3 + i * 3], ttl_ms)
    end
  end
  for j = 1, nbudgets do
    local key = KEYS[nscopes * 3 + j]
    used[j] = redis.call('INCRBY', key, tonumber(ARGV[bargs + j * 3 - 1]))
    redis.call('EXPIRE', key, tonumber(ARGV[bargs + j * 3]))
  end
end
local out = {exceeded, tostring(wait), broke and 1 or 0}
for i = 1, nscopes do
  out[#out + 1] = tostring(levels[i][1])
  out[#out + 1] = tostring(levels[i][2])
end
for j = 1, nbudgets do out[#out + 1] = used[j] end  -- an integer reply: exact (tostring is not)
return out
"""

# The shared window levels of some scopes, changing nothing: what a replica remembers so that,
# if Redis goes away, its local windows start from them (not full). KEYS: 3 per scope as
# above; ARGV: 3 per scope (rpm, tpm, concurrency). Returns per scope the requests and tokens
# levels (-1: unlimited).
READ_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i = 0, #KEYS / 3 - 1 do
  for j = 1, 2 do
    local cap = tonumber(ARGV[j + i * 3])
    local l = -1
    if cap > 0 then
      local v = redis.call('HMGET', KEYS[j + i * 3], 'l', 's')
      l = cap
      if v[1] then
        l = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60
        if l > cap then l = cap end
      end
    end
    out[#out + 1] = tostring(l)
  end
end
return out
"""

# What replicas used on their own while Redis was away, charged when it is back, so an outage
# gives no tenant a second window. KEYS: 2 per scope (requests and tokens buckets); ARGV: 4
# per scope (rpm, tpm, requests, tokens; tokens negative for a refund that could not be
# settled). A window may go below zero: it is in debt and refills from there.
DEBIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 0, #KEYS / 2 - 1 do
  for j = 1, 2 do
    local cap, used, key = tonumber(ARGV[j + i * 4]), tonumber(ARGV[j + 2 + i * 4]), KEYS[j + i * 2]
    if cap > 0 and used ~= 0 then
      local v = redis.call('HMGET', key, 'l', 's')
      local l = cap
      if v[1] then
        l = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60
        if l > cap then l = cap end
      end
      l = l - used
      if l > cap then l = cap end
      redis.call('HSET', key, 'l', l, 's', now)
      redis.call('EXPIRE', key, 120)
    end
  end
end
return 1
"""

# Budget refunds (reserved - used; negative: more was used) that could not be settled when
# they were due, given back when Redis is back. KEYS: budget counters; ARGV: one refund each.
# A counter that expired (its period ended) is left alone.
REFUND_LUA = """
for j, key in ipairs(KEYS) do
  local used = redis.call('GET', key)
  if used then
    local left = tonumber(used) - tonumber(ARGV[j])
    if left < 0 then left = 0 end
    redis.call('SET', key, left, 'KEEPTTL')
  end
end
return 1
"""

# KEYS: 3 per scope as above, then 1 per budget charged. ARGV: token refund (reserved - used,
# may be negative), reservation id, number of scopes, then 2 per scope (tpm, concurrency),
# then the refund of each budget.
SETTLE_LUA = """
local refund = tonumber(ARGV[1])
local rid = ARGV[2]
local nscopes = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 0, nscopes - 1 do
  local tpm = tonumber(ARGV[4 + i * 2])
  local conc = tonumber(ARGV[5 + i * 2])
  if tpm > 0 then
    local v = redis.call('HMGET', KEYS[2 + i * 3], 'l', 's')
    local l = tpm
    if v[1] then
      l = tonumber(v[1]) + (now - tonumber(v[2])) * tpm / 60
      if l > tpm then l = tpm end
    end
    l = l + refund
    if l > tpm then l = tpm end
    redis.call('HSET', KEYS[2 + i * 3], 'l', l, 's', now)
    redis.call('EXPIRE', KEYS[2 + i * 3], 120)
  end
  if conc > 0 then redis.call('ZREM', KEYS[3 + i * 3], rid) end
end
for j = nscopes * 3 + 1, #KEYS do
  local back = tonumber(ARGV[3 + nscopes * 2 + j - nscopes * 3])
  local used = redis.call('GET', KEYS[j])
  if back ~= 0 and used then
    local left = tonumber(used) - back
    if left < 0 then left = 0 end
    redis.call('SET', KEYS[j], left, 'KEEPTTL')
  end
end
return 1
"""
