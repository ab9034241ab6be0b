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

# KEYS: 4 per scope (requests bucket, tokens bucket, live set, day counter).
# ARGV: tokens, reservation id, lease ttl ms, then 4 per scope (rpm, tpm, concurrency, daily;
# 0 = unlimited). The clock is Redis' own TIME, so every gateway replica agrees on it.
RESERVE_LUA = """
local tokens = tonumber(ARGV[1])
local rid = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nscopes = #KEYS / 4
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
  local rpm = tonumber(ARGV[4 + i * 4])
  local tpm = tonumber(ARGV[5 + i * 4])
  local conc = tonumber(ARGV[6 + i * 4])
  local daily = tonumber(ARGV[7 + i * 4])
  local rl, tl = -1, -1
  if rpm > 0 then
    rl = level_of(KEYS[1 + i * 4], rpm)
    if rl < 1 then note(1, (1 - rl) * 60 / rpm) end
  end
  if tpm > 0 then
    tl = level_of(KEYS[2 + i * 4], tpm)
    if tl < tokens then note(2, (tokens - tl) * 60 / tpm) end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3 + i * 4], '-inf', now * 1000)
    if redis.call('ZCARD', KEYS[3 + i * 4]) >= conc then note(3, 1) end
  end
  local du = -1
  if daily > 0 then
    du = tonumber(redis.call('GET', KEYS[4 + i * 4]) or '0')
    if du + tokens > daily then note(4, 86400 - (now % 86400)) end
  end
  levels[i + 1] = {rl, tl, du}
end
if exceeded == 0 then
  for i = 0, nscopes - 1 do
    local rpm = tonumber(ARGV[4 + i * 4])
    local tpm = tonumber(ARGV[5 + i * 4])
    local conc = tonumber(ARGV[6 + i * 4])
    local daily = tonumber(ARGV[7 + i * 4])
    if rpm > 0 then
      levels[i + 1][1] = levels[i + 1][1] - 1
      redis.call('HSET', KEYS[1 + i * 4], 'l', levels[i + 1][1], 's', now)
      redis.call('EXPIRE', KEYS[1 + i * 4], 120)
    end
    if tpm > 0 then
      levels[i + 1][2] = levels[i + 1][2] - tokens
      redis.call('HSET', KEYS[2 + i * 4], 'l', levels[i + 1][2], 's', now)
      redis.call('EXPIRE', KEYS[2 + i * 4], 120)
    end
    if conc > 0 then
      redis.call('ZADD', KEYS[3 + i * 4], now * 1000 + ttl_ms, rid)
      redis.call('PEXPIRE', KEYS[3 + i * 4], ttl_ms)
    end
    if daily > 0 then
      redis.call('INCRBY', KEYS[4 + i * 4], tokens)
      redis.call('EXPIRE', KEYS[4 + i * 4], 172800)
      levels[i + 1][3] = levels[i + 1][3] + tokens
    end
  end
end
local out = {exceeded, tostring(wait), tostring(levels[1][1]), tostring(levels[1][2]),
             math.floor(now / 86400)}
for i = 1, nscopes do
  for j = 1, 3 do out[#out + 1] = tostring(levels[i][j]) end
end
return out
"""

# The shared levels of some scopes, changing nothing: what a replica remembers so that, if
# Redis goes away, its local windows start from them (not full). KEYS: 4 per scope as above;
# ARGV: 4 per scope (rpm, tpm, concurrency, daily). Returns the day, then per scope the
# requests level, tokens level and daily tokens used (-1: unlimited).
READ_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {math.floor(now / 86400)}
for i = 0, #KEYS / 4 - 1 do
  local rpm = tonumber(ARGV[1 + i * 4])
  local tpm = tonumber(ARGV[2 + i * 4])
  local daily = tonumber(ARGV[4 + i * 4])
  local rl, tl, du = -1, -1, -1
  for _, pair in ipairs({{1, rpm}, {2, tpm}}) do
    local cap = pair[2]
    if cap > 0 then
      local v = redis.call('HMGET', KEYS[pair[1] + i * 4], 'l', 's')
      local l = cap
      if v[1] then
        l = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60
        if l > cap then l = cap end
      end
      if pair[1] == 1 then rl = l else tl = l end
    end
  end
  if daily > 0 then du = tonumber(redis.call('GET', KEYS[4 + i * 4]) or '0') end
  out[#out + 1] = tostring(rl)
  out[#out + 1] = tostring(tl)
  out[#out + 1] = tostring(du)
end
return out
"""

# What replicas used on their own while Redis was away, charged when it is back, so an outage
# gives no tenant a second window or a second day. KEYS: 4 per scope as above (the day key of
# the day the tokens were used); ARGV: 5 per scope (rpm, tpm, daily, requests, tokens; tokens
# negative for a refund that could not be settled). A window may go below zero: it is in debt
# and refills from there.
DEBIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 0, #KEYS / 4 - 1 do
  local caps = {tonumber(ARGV[1 + i * 5]), tonumber(ARGV[2 + i * 5])}
  local daily = tonumber(ARGV[3 + i * 5])
  local used = {tonumber(ARGV[4 + i * 5]), tonumber(ARGV[5 + i * 5])}
  for j = 1, 2 do
    local cap, key = caps[j], KEYS[j + i * 4]
    if cap > 0 and used[j] ~= 0 then
      local v = redis.call('HMGET', key, 'l', 's')
      local l = cap
      if v[1] then
        l = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60
        if l > cap then l = cap end
      end
      l = l - used[j]
      if l > cap then l = cap end
      redis.call('HSET', key, 'l', l, 's', now)
      redis.call('EXPIRE', key, 120)
    end
  end
  if daily > 0 and used[2] ~= 0 then
    local day = tonumber(redis.call('GET', KEYS[4 + i * 4]) or '0') + used[2]
    if day < 0 then day = 0 end
    redis.call('SET', KEYS[4 + i * 4], day, 'EX', 172800)
  end
end
return 1
"""

# KEYS: as above. ARGV: refund (reserved - used, may be negative), reservation id, then
# 4 per scope as above.
SETTLE_LUA = """
local refund = tonumber(ARGV[1])
local rid = ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nscopes = #KEYS / 4
for i = 0, nscopes - 1 do
  local tpm = tonumber(ARGV[4 + i * 4])
  local conc = tonumber(ARGV[5 + i * 4])
  local daily = tonumber(ARGV[6 + i * 4])
  if tpm > 0 then
    local v = redis.call('HMGET', KEYS[2 + i * 4], 'l', 's')
    local l = tpm
    if v[1] then
      l = tonumber(v[1]) + (now - tonumber(v[2])) * tpm / 60
      if l > tpm then l = tpm end
    end
    l = l + refund
    if l > tpm then l = tpm end
    redis.call('HSET', KEYS[2 + i * 4], 'l', l, 's', now)
    redis.call('EXPIRE', KEYS[2 + i * 4], 120)
  end
  if conc > 0 then redis.call('ZREM', KEYS[3 + i * 4], rid) end
  if daily > 0 and refund ~= 0 then
    local used = tonumber(redis.call('GET', KEYS[4 + i * 4]) or '0') - refund
    if used < 0 then used = 0 end
    redis.call('SET', KEYS[4 + i * 4], used, 'KEEPTTL')
  end
end
return 1
"""
