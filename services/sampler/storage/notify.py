"""Wake-ups for long-polls and the producer, fed by Redis pub/sub.

Everything that changes what a waiter waits for (a batch sealed, a version published,
an eval finished) is announced on the run's events channel, by whichever process made
the change. One listener task per process turns each message into a broadcast: every
waiter wakes and re-checks Redis. So a long-poll wakes within a round trip of the seal,
with no fixed-interval polling, and it works across sampler replicas.

The waiting pattern that cannot miss a wake-up: take `changed()` first, then check the
state, then await the event taken before the check.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.sampler.storage.redis_link import RedisLink, is_outage
from shared.aio import wait_event

log = logging.getLogger("tandem.sampler.notify")


class Notifier:
    def __init__(self, redis_url: str, channel: str, link: RedisLink | None = None):
        self.redis_url = redis_url
        self.channel = channel
        # Reports an unreachable Redis (one warning per outage) and says when to try again.
        self.link = link
        self._event = asyncio.Event()
        self.connected = asyncio.Event()
        # Messages seen per topic (the part of a message before ":"), and subscriptions made:
        # a waiter that only cares about one topic re-reads Redis only when either moved.
        self._topics: dict[str, int] = {}
        self._subscriptions = 0

    def changed(self) -> asyncio.Event:
        """An event that is set at the next change after this call."""
        return self._event

    def generation(self, topic: str) -> tuple[int, int]:
        """A value that changes whenever a `topic` message arrives ("servers": membership) or
        the subscription is made again (messages may have been missed meanwhile)."""
        return self._subscriptions, self._topics.get(topic, 0)

    def notify(self) -> None:
        """Wake every waiter (they re-check the state themselves)."""
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def run(self) -> None:
        """Listen forever, reconnecting with backoff; wakes everyone after a reconnect."""
        delay = 0.1
        while True:
            # No socket timeout: an idle subscription is normal, and health checks detect dead peers.
            client = aioredis.from_url(self.redis_url, socket_timeout=None, health_check_interval=15)
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                self.connected.set()
                # Messages may have been missed while disconnected: everyone re-checks.
                self._subscriptions += 1
                self.notify()
                delay = 0.1
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        data = message.get("data")
                        topic = (data.decode(errors="replace") if isinstance(data, bytes) else str(data)).split(":")[0]
                        self._topics[topic] = self._topics.get(topic, 0) + 1
                        self.notify()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self.connected.clear()
                if self.link is not None and is_outage(exc):
                    # Redis is down: the link says so once; reconnect as soon as it is back.
                    self.link.report(exc)
                    log.debug("event subscription lost (%s); reconnecting when Redis is back", exc)
                    await wait_event(self.link.up, delay)
                else:
                    log.warning("event subscription lost (%s); reconnecting in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            finally:
                try:
                    await pubsub.aclose()
                    await client.aclose()
                except (RedisError, OSError):
                    pass
