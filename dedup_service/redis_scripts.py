"""Lua scripts of the Redis store: each multi-step state change is one script, so it is atomic.

Conventions (the key layout is in redis_store.py):
- times are integer milliseconds of the caller's injected clock (`now`); no script reads Redis time, so
  tests move time without sleeping. PEXPIRE only garbage-collects, well after the logical expiry.
- epochs travel as decimal strings and are compared as strings (Python formats ints canonically).
- scripts derive the request-index and log keys of a record from its stored request id and the quoted
  tenant `S` they are given (the one in the record's key), so they target a standalone Redis (or one
  shard), not Redis Cluster.
- every script starts with a Redis 7 shebang (so Redis 7.0 or later is required). `#!lua` with no flags
  declares a script that may write: when Redis is over `maxmemory` (noeviction) it is refused whole, before
  it runs, with an OOM error, never stopped halfway. (Without a shebang Redis checks memory only at the
  script's first write that grows memory, after any DEL or PEXPIRE before it, and then lets it write on
  past maxmemory.) `flags=no-writes` declares a read, which Redis runs even when full, so resumes and
  lookups keep working then.
"""

from __future__ import annotations

WRITES = "#!lua\n"
READS = "#!lua flags=no-writes\n"

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
-- The request index, log meta and log stream keys of a request id of the tenant quoted as S.
local function request_keys(P, S, rid)
  local scoped = S .. ':' .. rid
  return P .. 'req:' .. scoped, P .. 'logm:' .. scoped, P .. 'log:' .. scoped
end
"""

# KEYS: record. ARGV: prefix, quoted tenant, key, owner, fingerprint, request_id, lease_ms, now_ms,
# running_gc_ms, batch set key ('' when not a batch item), seq_id, batch_gc_ms, payload (request bytes, stored
# as `pl` only when the record is created; TAKEOVER and the WRITE ops leave it as it is).
# Returns {outcome, HGETALL of the record} (an empty list for REQUEST_ID_IN_USE).
CLAIM = (
    WRITES
    + HELPERS
    + """
local rk = KEYS[1]
local P, S, key, owner, fp, rid = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local lease, now, gc = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])

local function add_to_batch()
  if ARGV[10] ~= '' then
    redis.call('ZADD', ARGV[10], 0, ARGV[11])
    redis.call('PEXPIRE', ARGV[10], ARGV[12])
  end
end

-- Point the request index at (owner, epoch); open a fresh log, or keep the logged tokens on takeover.
local function index(r_rid, epoch, fresh)
  local ik, mk, lk = request_keys(P, S, r_rid)
  redis.call('DEL', ik)
  redis.call('HSET', ik, 'key', key, 'rk', rk, 'own', owner, 'ep', epoch, 'st', 'INIT')
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

-- The tenant's request id names one request: its key, or none (a keyless request).
local held = redis.call('HGET', (request_keys(P, S, rid)), 'key')
if held and held ~= key then return {'REQUEST_ID_IN_USE', {}} end
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

# KEYS: record. ARGV: prefix, quoted tenant, owner, epoch, now_ms, op, ms (lease or retention), value,
# running_gc_ms, slack_ms.
# op: renew | processing | success (value = result) | failed (value = error) | release (retryable failure).
# Returns 1, or 0 when (owner, epoch) do not own the running record.
WRITE = (
    WRITES
    + HELPERS
    + """
local rk = KEYS[1]
local P, S, op = ARGV[1], ARGV[2], ARGV[6]
local now, span, gc, slack = tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[9]), tonumber(ARGV[10])
local rid = owned(rk, ARGV[3], ARGV[4])
if not rid then return 0 end
local ik = request_keys(P, S, rid)
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
  redis.call('HSET', rk, 'st', st, field, ARGV[8], 'exp', now + span)
  redis.call('PEXPIRE', rk, span + slack)
  redis.call('HSET', ik, 'st', st)
  redis.call('PEXPIRE', ik, span + slack)
elseif op == 'release' then
  -- Server's fault: forget the record so a retry runs anew, keeping only its epoch (a tombstone).
  redis.call('DEL', rk)
  redis.call('HSET', rk, 'ep', ARGV[4])
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
# ARGV: prefix, quoted tenant, mode, now_ms, running_gc_ms, request_id (mode 'rid').
# Returns 1 when a live record (mode 'key') or the tenant's request (mode 'rid') existed.
PURGE = (
    WRITES
    + HELPERS
    + """
local P, S, mode, now, gc = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local function drop_request(rid)
  redis.call('DEL', request_keys(P, S, rid))
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
local rk = redis.call('HGET', KEYS[1], 'rk')
if not rk then return 0 end
local rid = ARGV[6]
if rk ~= '' then purge_record(rk, rid) end
drop_request(rid)
return 1
"""
)

# KEYS: request index, log meta, log stream. ARGV: owner, running_gc_ms, payload.
# Returns 0 when the tenant's request id is taken.
START_REQUEST = (
    WRITES
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'key', '', 'rk', '', 'own', ARGV[1], 'ep', 1, 'st', 'PROCESSING', 'pl', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[2], 'n', 0, 'fin', 0, 'exp', 0)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""
)

# KEYS: request index, log meta, log stream. ARGV: owner, epoch (the one the caller saw), running_gc_ms.
# Moves a running keyless request to (owner, epoch + 1), keeping its log. Returns the new epoch, or nil when
# the request is keyed, finished, gone, or no longer at `epoch`.
TAKE_REQUEST = (
    WRITES
    + """
local ix = redis.call('HMGET', KEYS[1], 'key', 'st', 'ep')
if ix[1] ~= '' or ix[2] ~= 'PROCESSING' or ix[3] ~= ARGV[2] then return false end
if redis.call('HGET', KEYS[2], 'fin') ~= '0' then return false end
local epoch = tonumber(ARGV[2]) + 1
redis.call('HSET', KEYS[1], 'own', ARGV[1], 'ep', epoch)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3], 'GT') end
return epoch
"""
)

# KEYS: request index, log meta. Returns {HGETALL of the index, {n, fin, exp} of the log meta}.
LOOKUP = (
    READS
    + """
return {redis.call('HGETALL', KEYS[1]), redis.call('HMGET', KEYS[2], 'n', 'fin', 'exp')}
"""
)

# KEYS: log meta, log stream. ARGV: offset, count.
# Returns {n, fin, info, exp, entries from token `offset` on (at most count)}, read at one instant.
READ = (
    READS
    + """
local m = redis.call('HMGET', KEYS[1], 'n', 'fin', 'info', 'exp')
local rows = redis.call('XRANGE', KEYS[2], '0-' .. (tonumber(ARGV[1]) + 1), '+', 'COUNT', ARGV[2])
local entries = {}
for _, row in ipairs(rows) do
  local f = row[2]
  if f[1] == 'e' then entries[#entries + 1] = f[2] end
end
return {m[1], m[2], m[3], m[4], entries}
"""
)

# KEYS: (request index, log meta, log stream) per request. ARGV: running_gc_ms, then per request: owner,
# epoch, offset, entry count, packed entries...
# Token i of a log is stream entry 0-(i+1), so a read from offset o is XRANGE from 0-(o+1).
# Each request's append is refused (0) when fenced out, finished, or the offset is not the log's length; 1
# when written. One script for the whole batch: under OOM it is refused whole, never half written.
APPEND_MANY = (
    WRITES
    + """
local gc = ARGV[1]
local done = {}
local a = 2
for k = 1, #KEYS, 3 do
  local ik, mk, lk = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local owner, epoch, offset = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local first = a + 4
  a = first + tonumber(ARGV[a + 3])
  local ok = 0
  local ix = redis.call('HMGET', ik, 'own', 'ep')
  local m = redis.call('HMGET', mk, 'n', 'fin')
  if ix[1] == owner and ix[2] == epoch and m[1] == offset and m[2] == '0' then
    local n = tonumber(offset)
    for i = first, a - 1 do
      n = n + 1
      redis.call('XADD', lk, '0-' .. n, 'e', ARGV[i])
    end
    redis.call('HSET', mk, 'n', n)
    redis.call('PEXPIRE', ik, gc, 'GT')
    redis.call('PEXPIRE', mk, gc)
    redis.call('PEXPIRE', lk, gc)
    ok = 1
  end
  done[#done + 1] = ok
end
return done
"""
)

# KEYS: request index, log meta, log stream. ARGV: owner, epoch, finish_info, keep_ms, now_ms, slack_ms, failed.
# Adds an 'end' entry after the last token so blocked XREADs wake. Returns 0 when fenced out or finished.
FINISH = (
    WRITES
    + """
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
)

# KEYS: content lease. ARGV: request_id, owner, lease_ms, now_ms, slack_ms. Returns {1 if we lead, leader id}.
CONTENT_CLAIM = (
    WRITES
    + """
local h = redis.call('HMGET', KEYS[1], 'rid', 'lease')
if h[1] and tonumber(h[2]) > tonumber(ARGV[4]) then return {0, h[1]} end
redis.call('HSET', KEYS[1], 'rid', ARGV[1], 'own', ARGV[2], 'lease', tonumber(ARGV[4]) + tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[5]))
return {1, ARGV[1]}
"""
)

# KEYS: content lease. ARGV: request_id, lease_ms ('' to release), now_ms, slack_ms. Returns 1 when it was ours.
CONTENT_RENEW = (
    WRITES
    + """
if redis.call('HGET', KEYS[1], 'rid') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'lease', tonumber(ARGV[3]) + tonumber(ARGV[2]))
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + tonumber(ARGV[4]))
end
return 1
"""
)
