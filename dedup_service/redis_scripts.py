"""Lua scripts of the Redis store: each multi-step state change is one script, so it is atomic.

Conventions (the key layout is in redis_store.py):
- times are integer milliseconds of the caller's injected clock (`now`); no script reads Redis time, so
  tests move time without sleeping. PEXPIRE only garbage-collects, well after the logical expiry.
- epochs travel as decimal strings and are compared as strings (Python formats ints canonically).
- scripts derive the request-index and log keys of a record from its stored request id, so they target a
  standalone Redis (or one shard), not Redis Cluster.
"""

from __future__ import annotations

HELPERS = """
local function hash(key)
  local flat = redis.call('HGETALL', key)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h
end
local function running(st) return st == 'INIT' or st == 'PROCESSING' end
-- The request id of a record that (owner, epoch) may write: running and theirs. Else false.
local function owned(rk, owner, epoch)
  local r = redis.call('HMGET', rk, 'st', 'own', 'ep', 'rid')
  if running(r[1]) and r[2] == owner and r[3] == epoch then return r[4] end
  return false
end
"""

# KEYS: record. ARGV: prefix, tenant, key, owner, fingerprint, request_id, lease_ms, now_ms, running_gc_ms,
# batch set key ('' when not a batch item), seq_id, batch_gc_ms, payload (request bytes, stored as `pl` only
# when the record is created; TAKEOVER and the WRITE ops leave it as it is).
# Returns {outcome, HGETALL of the record} (an empty list for REQUEST_ID_IN_USE).
CLAIM = (
    HELPERS
    + """
local rk = KEYS[1]
local P, tenant, key, owner, fp, rid = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local lease, now, gc = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])

local function add_to_batch()
  if ARGV[10] ~= '' then
    redis.call('ZADD', ARGV[10], 0, ARGV[11])
    redis.call('PEXPIRE', ARGV[10], ARGV[12])
  end
end

-- Point the request index at (owner, epoch); open a fresh log, or keep the logged tokens on takeover.
local function index(r_rid, epoch, fresh)
  local ik, mk, lk = P .. 'req:' .. r_rid, P .. 'logm:' .. r_rid, P .. 'log:' .. r_rid
  redis.call('DEL', ik)
  redis.call('HSET', ik, 'tenant', tenant, 'key', key, 'rk', rk, 'own', owner, 'ep', epoch, 'st', 'INIT')
  redis.call('PEXPIRE', ik, gc)
  if fresh or redis.call('EXISTS', mk) == 0 then
    redis.call('DEL', mk, lk)
    redis.call('HSET', mk, 'n', 0, 'fin', 0, 'exp', 0)
  end
  redis.call('PEXPIRE', mk, gc)
  redis.call('PEXPIRE', lk, gc)
end

local h = hash(rk)
if h.st and (running(h.st) or tonumber(h.exp) > now) then
  local outcome
  if h.fp ~= fp then outcome = 'KEY_REUSED'
  elseif h.st == 'SUCCESS' then outcome = 'REPLAY'
  elseif h.st == 'FAILED' then outcome = 'REPLAY_ERROR'
  elseif tonumber(h.lease) > now then outcome = 'ATTACH'
  else
    -- The owner stopped renewing: a new epoch fences it out.
    outcome = 'TAKEOVER'
    local epoch = tonumber(h.ep) + 1
    redis.call('HSET', rk, 'st', 'INIT', 'own', owner, 'ep', epoch, 'lease', now + lease)
    redis.call('PEXPIRE', rk, lease + gc)
    index(h.rid, epoch, false)
  end
  add_to_batch()
  return {outcome, redis.call('HGETALL', rk)}
end

local held = redis.call('HMGET', P .. 'req:' .. rid, 'tenant', 'key')
if held[1] and (held[1] ~= tenant or held[2] ~= key) then return {'REQUEST_ID_IN_USE', {}} end
-- Epochs keep growing across releases (a tombstone keeps 'ep'), so a stale writer never matches.
local epoch = (tonumber(h.ep) or 0) + 1
redis.call('DEL', rk)
redis.call('HSET', rk, 'st', 'INIT', 'own', owner, 'ep', epoch, 'fp', fp, 'rid', rid, 'lease', now + lease, 'exp', 0,
  'pl', ARGV[13])
redis.call('PEXPIRE', rk, lease + gc)
index(rid, epoch, true)
add_to_batch()
return {'CLAIMED', redis.call('HGETALL', rk)}
"""
)

# KEYS: record. ARGV: prefix, owner, epoch, now_ms, op, ms (lease or retention), value, running_gc_ms, slack_ms.
# op: renew | processing | success (value = result) | failed (value = error) | release (retryable failure).
# Returns 1, or 0 when (owner, epoch) do not own the running record.
WRITE = (
    HELPERS
    + """
local rk = KEYS[1]
local P, op = ARGV[1], ARGV[5]
local now, span, gc, slack = tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[8]), tonumber(ARGV[9])
local rid = owned(rk, ARGV[2], ARGV[3])
if not rid then return 0 end
local ik = P .. 'req:' .. rid
if op == 'renew' then
  redis.call('HSET', rk, 'lease', now + span)
  redis.call('PEXPIRE', rk, span + gc)
  redis.call('PEXPIRE', ik, gc, 'GT')
elseif op == 'processing' then
  redis.call('HSET', rk, 'st', 'PROCESSING')
  redis.call('HSET', ik, 'st', 'PROCESSING')
elseif op == 'success' or op == 'failed' then
  local st, field = 'SUCCESS', 'res'
  if op == 'failed' then st, field = 'FAILED', 'err' end
  redis.call('HSET', rk, 'st', st, field, ARGV[7], 'exp', now + span)
  redis.call('PEXPIRE', rk, span + slack)
  redis.call('HSET', ik, 'st', st)
  redis.call('PEXPIRE', ik, span + slack)
elseif op == 'release' then
  -- Server's fault: forget the record so a retry runs anew, keeping only its epoch (a tombstone).
  redis.call('DEL', rk)
  redis.call('HSET', rk, 'ep', ARGV[3])
  redis.call('PEXPIRE', rk, gc)
  redis.call('HSET', ik, 'st', 'FAILED')
  redis.call('PEXPIRE', ik, gc)
else
  return redis.error_reply('unknown op ' .. op)
end
return 1
"""
)

# KEYS: record (mode 'key') or request index (mode 'rid').
# ARGV: prefix, mode, tenant, now_ms, running_gc_ms, request_id (mode 'rid').
# Returns 1 when a live record (mode 'key') or the tenant's request (mode 'rid') existed.
PURGE = (
    HELPERS
    + """
local P, mode, tenant, now, gc = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local function drop_request(rid)
  redis.call('DEL', P .. 'req:' .. rid, P .. 'logm:' .. rid, P .. 'log:' .. rid)
end
-- Delete a record (keeping its epoch as a tombstone) and its request; 1 when it was live.
local function purge_record(rk, only_rid)
  local r = redis.call('HMGET', rk, 'st', 'ep', 'rid', 'exp')
  if not r[1] or (only_rid and r[3] ~= only_rid) then return 0 end
  redis.call('DEL', rk)
  redis.call('HSET', rk, 'ep', r[2])
  redis.call('PEXPIRE', rk, gc)
  drop_request(r[3])
  if running(r[1]) or tonumber(r[4]) > now then return 1 end
  return 0
end
if mode == 'key' then return purge_record(KEYS[1], false) end
local x = redis.call('HMGET', KEYS[1], 'tenant', 'rk')
if x[1] ~= tenant then return 0 end
local rid = ARGV[6]
if x[2] ~= '' then purge_record(x[2], rid) end
drop_request(rid)
return 1
"""
)

# KEYS: request index. ARGV: prefix, tenant, owner, request_id, running_gc_ms. Returns 0 when the id is taken.
START_REQUEST = """
local P, rid, gc = ARGV[1], ARGV[4], ARGV[5]
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'tenant', ARGV[2], 'key', '', 'rk', '', 'own', ARGV[3], 'ep', 1, 'st', 'PROCESSING')
redis.call('PEXPIRE', KEYS[1], gc)
local mk = P .. 'logm:' .. rid
redis.call('DEL', mk, P .. 'log:' .. rid)
redis.call('HSET', mk, 'n', 0, 'fin', 0, 'exp', 0)
redis.call('PEXPIRE', mk, gc)
return 1
"""

# KEYS: request index, log meta, log stream. ARGV: owner, epoch, offset, running_gc_ms, packed entries...
# Token i of the log is stream entry 0-(i+1), so a read from offset o is XRANGE from 0-(o+1).
# Returns 1, or 0 when fenced out, finished, or the offset is not the log's length.
APPEND = """
local ix = redis.call('HMGET', KEYS[1], 'own', 'ep')
if ix[1] ~= ARGV[1] or ix[2] ~= ARGV[2] then return 0 end
local m = redis.call('HMGET', KEYS[2], 'n', 'fin')
if m[1] ~= ARGV[3] or m[2] ~= '0' then return 0 end
local n = tonumber(m[1])
for i = 5, #ARGV do
  n = n + 1
  redis.call('XADD', KEYS[3], '0-' .. n, 'e', ARGV[i])
end
redis.call('HSET', KEYS[2], 'n', n)
redis.call('PEXPIRE', KEYS[1], ARGV[4], 'GT')
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return 1
"""

# KEYS: request index, log meta, log stream. ARGV: owner, epoch, finish_info, keep_ms, now_ms, slack_ms, failed.
# Adds an 'end' entry after the last token so blocked XREADs wake. Returns 0 when fenced out or finished.
FINISH = """
local ix = redis.call('HMGET', KEYS[1], 'own', 'ep', 'key')
if ix[1] ~= ARGV[1] or ix[2] ~= ARGV[2] then return 0 end
local m = redis.call('HMGET', KEYS[2], 'n', 'fin')
if not m[1] or m[2] ~= '0' then return 0 end
local keep, now = tonumber(ARGV[4]), tonumber(ARGV[5])
local ttl = keep + tonumber(ARGV[6])
redis.call('HSET', KEYS[2], 'fin', 1, 'info', ARGV[3], 'exp', now + keep)
redis.call('XADD', KEYS[3], '0-' .. (tonumber(m[1]) + 1), 'end', 1)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
if ix[3] == '' then
  local st = 'SUCCESS'
  if ARGV[7] == '1' then st = 'FAILED' end
  redis.call('HSET', KEYS[1], 'st', st)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return 1
"""

# KEYS: content lease. ARGV: request_id, owner, lease_ms, now_ms, slack_ms. Returns {1 if we lead, leader id}.
CONTENT_CLAIM = """
local h = redis.call('HMGET', KEYS[1], 'rid', 'lease')
if h[1] and tonumber(h[2]) > tonumber(ARGV[4]) then return {0, h[1]} end
redis.call('HSET', KEYS[1], 'rid', ARGV[1], 'own', ARGV[2], 'lease', tonumber(ARGV[4]) + tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[5]))
return {1, ARGV[1]}
"""

# KEYS: content lease. ARGV: request_id, lease_ms ('' to release), now_ms, slack_ms. Returns 1 when it was ours.
CONTENT_RENEW = """
if redis.call('HGET', KEYS[1], 'rid') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'lease', tonumber(ARGV[3]) + tonumber(ARGV[2]))
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + tonumber(ARGV[4]))
end
return 1
"""
