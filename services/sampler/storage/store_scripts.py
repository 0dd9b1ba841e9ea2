"""The sampler's Lua scripts on Redis (store.py runs them): each is one atomic step.

Kept apart from store.py so that the store reads as the operations it offers; the scripts'
KEYS and ARGV are documented above each one, and store.py is their only caller.
"""

# KEYS: manifest, sealed, meta. ARGV: step, channel, build, chunk count, chunk key prefix,
# chunk table (JSON), stats (JSON), files directory ('' when the chunks are Redis strings).
# Returns 1 when sealed now; 2 when this build sealed it before (a repeat: nothing changes);
# 0 when another build sealed it first (this build's Redis chunks are deleted here, its files
# by the caller); -1 when the step was trimmed (likewise); -2 when a Redis chunk is missing
# (expired, or lost by a restarted Redis): write them again. Chunk files are durable before
# this runs (chunk_files.py), so only Redis chunks are checked here.
SEAL = """
local n = tonumber(ARGV[4])
local files = ARGV[8] ~= ''
local function drop()
  if not files then for i = 0, n - 1 do redis.call('DEL', ARGV[5] .. i) end end
end
local trimmed = tonumber(redis.call('HGET', KEYS[3], 'trimmed_below') or '0')
if tonumber(ARGV[1]) < trimmed then drop() return -1 end
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'none' then
  if kind == 'hash' and redis.call('HGET', KEYS[1], 'build') == ARGV[3] then
    if files and redis.call('HGET', KEYS[1], 'dir') ~= ARGV[8] then return 0 end
    return 2
  end
  drop()
  return 0
end
if not files then
  for i = 0, n - 1 do
    if redis.call('EXISTS', ARGV[5] .. i) == 0 then return -2 end
  end
  for i = 0, n - 1 do redis.call('PERSIST', ARGV[5] .. i) end
end
redis.call('HSET', KEYS[1], 'build', ARGV[3], 'chunks', n, 'table', ARGV[6], 'stats', ARGV[7])
if files then redis.call('HSET', KEYS[1], 'dir', ARGV[8]) end
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], 'sealed:' .. ARGV[1])
return 1
"""

# KEYS: meta, probe. ARGV: version, checkpoint_path ('' for none), channel, time, probe JSON ('' for none),
# adapter ('1': checkpoint_path is a LoRA adapter, '0': full weights).
# Returns {outcome, previous}: outcome 2 = advanced, 1 = same version again, 0 = refused (lower).
# The probe and the adapter flag belong to the version: written (or deleted) in the same step.
PUBLISH = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local v = tonumber(ARGV[1])
if v < cur then return {0, cur} end
if v == cur then return {1, cur} end
redis.call('HSET', KEYS[1], 'version', v, 'checkpoint_path', ARGV[2], 'published_at', ARGV[4], 'adapter', ARGV[6])
if ARGV[5] == '' then redis.call('DEL', KEYS[2]) else redis.call('SET', KEYS[2], ARGV[5]) end
redis.call('PUBLISH', ARGV[3], 'version:' .. v)
return {2, cur}
"""

# KEYS: meta, sealed. ARGV: trim_below, prefix, resume_step ('' when the trainer sent none).
# Deletes batches below min(trim_below, resume_step); the trainer's resume step is recorded
# (what /status and the 410 report), and the mark never moves back. Returns {how many batches
# went, the mark now, the files directory of each that had one}: the caller deletes those.
TRIM = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'trimmed_below') or '0')
local upto = tonumber(ARGV[1])
if ARGV[3] ~= '' then
  local hold = tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'resume_step', hold)
  if hold < upto then upto = hold end
end
if upto <= cur then return {0, cur} end
local out = {0, upto}
local steps = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. upto)
for _, s in ipairs(steps) do
  local key = ARGV[2] .. 'batch:' .. s
  if redis.call('TYPE', key).ok == 'hash' then
    local m = redis.call('HMGET', key, 'build', 'chunks', 'dir')
    if m[3] then
      table.insert(out, m[3])
    else
      for i = 0, tonumber(m[2]) - 1 do redis.call('DEL', key .. ':' .. m[1] .. ':' .. i) end
    end
  end
  redis.call('DEL', key)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. upto)
redis.call('HSET', KEYS[1], 'trimmed_below', upto)
out[1] = #steps
return out
"""


# KEYS: claim, sealed. ARGV: step, owner, ttl_ms. Takes or extends the lease on generating a
# step: 2 = taken now (nobody held it: a new claim, or one a Redis restart lost), 1 = extended
# (we hold it), 0 = another replica holds it, -1 = already sealed (checked in the same atomic
# step, so a claim released right after its seal can never be taken for a second generation
# of that step).
LEASE = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return -1 end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 2
"""

# KEYS: members. ARGV: url, removed record (JSON), channel. 1 = removed now, 0 = not a member.
REMOVE_MEMBER = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local removed = cjson.decode(raw)['removed_at']
if removed ~= nil and removed ~= cjson.null then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', ARGV[3], 'servers')
return 1
"""

# KEYS: claim. ARGV: owner. Deletes the lease only if we hold it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: meta, servers, sealed. ARGV: the version this process acknowledged (it counts even if a
# restarted Redis lost it). Returns {meta's fields, servers' fields (both as HGETALL lists), the
# sealed steps from the floor = max(version, trimmed_below, ARGV[1]) on}: what the producer plans
# from, in one round trip instead of three (it plans at every wake-up, several times a step).
PLAN_VIEW = """
local meta = redis.call('HGETALL', KEYS[1])
local floor = tonumber(ARGV[1])
for i = 1, #meta, 2 do
  if meta[i] == 'version' or meta[i] == 'trimmed_below' then floor = math.max(floor, tonumber(meta[i + 1])) end
end
local sealed = redis.call('ZRANGEBYSCORE', KEYS[3], string.format('%.0f', floor), '+inf')
return {meta, redis.call('HGETALL', KEYS[2]), sealed}
"""
