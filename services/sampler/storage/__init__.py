"""Durable state and Redis: batches (manifest, chunks in files or Redis, packing), key names,
Lua scripts, the replay pool, run identity, wake-ups, the Redis link, the embedded server and
the task supervisor. Bottom room: may import config only."""
