"""A Dramatiq app for the system tests of keys held by several at once (``lock_limit``) and ``lock_on_busy``.

Configured by environment variables: ``LIMIT_TEST_BROKER_URL`` (``redis://`` or ``amqp://``),
``LIMIT_TEST_LEASES_URL``, ``LIMIT_TEST_RECORD_URL`` (a Redis URL where the app records what happened),
``LIMIT_TEST_QUEUE`` (the jobs' queue, unique per test; holder ``i`` consumes ``<queue>-hold<i>``).

Records, in the record Redis: the list ``runs`` (JSON: ``kind`` "start" at an actor's entry, "run" at its
end, with both instants; "holding" when a holder starts to hold), the list ``sent`` (each message a test
sent, with the instant just before its send), the lists ``acks`` and ``nacks`` (message id and instant), the
hash ``delivered`` (each message's first delivery to a worker) and the hash ``enqueues`` (per message id).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import dramatiq
import redis
from dramatiq.middleware import Middleware

from dramatiq_leases import LeaseMiddleware, current_lease

BROKER_URL = os.environ["LIMIT_TEST_BROKER_URL"]
QUEUE = os.environ.get("LIMIT_TEST_QUEUE", "default")
#: The lease TTL of every actor (ms).
TTL = 2_000
#: How many holder actors (each on a queue of its own, so that each is taken by the worker started for it).
HOLDERS = 3
record = redis.Redis.from_url(os.environ["LIMIT_TEST_RECORD_URL"])

broker: dramatiq.Broker
if BROKER_URL.startswith("amqp"):
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker = RabbitmqBroker(url=BROKER_URL, confirm_delivery=True)  # as docs/deployment.md says
else:
    from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker

    # Redeliver a dead worker's messages within seconds, not Dramatiq's default minute.
    broker = RedisBroker(url=BROKER_URL, heartbeat_timeout=3_000, maintenance_chance=MAINTENANCE_SCALE)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated


class Trace(Middleware):
    """What the broker did with each message: enqueues, first delivery, acks and nacks, with their instants.

    Added before LeaseMiddleware: its before-hook sees a delivery before the lease is asked for.
    """

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        record.hincrby("enqueues", message.message_id, 1)

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        record.hsetnx("delivered", message.message_id, time.time())

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        record.rpush("acks", json.dumps({"message_id": message.message_id, "at": time.time()}))

    def after_nack(self, broker: dramatiq.Broker, message: Any) -> None:
        record.rpush("nacks", json.dumps({"message_id": message.message_id, "at": time.time()}))


broker.add_middleware(Trace())
broker.add_middleware(LeaseMiddleware(redis_url=os.environ["LIMIT_TEST_LEASES_URL"]))
dramatiq.set_broker(broker)


def note(**event: object) -> None:
    """Record one event of an actor, with this process's id."""
    record.rpush("runs", json.dumps({"pid": os.getpid(), **event}))


def _lease_fields() -> dict[str, Any]:
    lease = current_lease()
    return {
        "key": lease.key,
        "fence": lease.fence,
        "slot": lease.slot,
        "message_id": lease.meta["message_id"],
        "first": int(lease.meta.get("first_attempt_ms") or lease.acquired_at * 1000),
    }


def _run(n: int, seconds: float, **args: Any) -> None:
    start = time.time()
    fields = _lease_fields()
    note(kind="start", n=n, start=start, **fields, **args)
    time.sleep(seconds)
    note(kind="run", n=n, start=start, end=time.time(), **fields, **args)


@dramatiq.actor(queue_name=QUEUE, lock_key="{key}", lock_ttl=TTL, max_retries=0)
def job(key: str, n: int, seconds: float) -> None:
    """A job of ``key``; its limit and policy come with the message (``lock_limit``, ``lock_on_busy``)."""
    _run(n, seconds)


@dramatiq.actor(queue_name=QUEUE, lock_key="{key}", lock_ttl=TTL)
def policy(key: str, n: int, seconds: float) -> None:
    """As :func:`job`, with Dramatiq's default retries: a busy policy must not spend them."""
    _run(n, seconds)


@dramatiq.actor(queue_name=QUEUE, lock_key="invoice:{invoice_id}", lock_ttl=TTL, max_retries=0)
def invoice(invoice_id: int, seconds: float = 0.1) -> None:
    """One job of an invoice, its key rendered from an argument given by position or by name."""
    _run(invoice_id, seconds)


@dramatiq.actor(queue_name=QUEUE, lock_key="{key}", lock_ttl=TTL, max_retries=0, lock_on_busy="latest")
def revision(key: str, n: int, seconds: float) -> None:
    """Revision ``n`` of ``key``'s document (``lock_on_busy="latest"``): held until the test sets ``release:<key>``
    or ``seconds`` have passed."""
    start = time.time()
    fields = _lease_fields()
    note(kind="start", n=n, start=start, **fields)
    while time.time() < start + seconds and not record.exists(f"release:{key}"):
        time.sleep(0.02)
    note(kind="run", n=n, start=start, end=time.time(), **fields)


def _hold(key: str, seconds: float) -> None:
    """Hold ``key`` until the test sets ``release:<key>`` in the record Redis, or ``seconds`` have passed."""
    start = time.time()
    fields = _lease_fields()
    note(kind="holding", n=-1, start=start, **fields)
    while time.time() < start + seconds and not record.exists(f"release:{key}"):
        time.sleep(0.02)
    note(kind="run", n=-1, start=start, end=time.time(), **fields)


#: ``holders[i]`` holds on the queue ``<queue>-hold<i>``: one per worker process started to hold.
holders = [
    dramatiq.actor(actor_name=f"hold{i}", queue_name=f"{QUEUE}-hold{i}", lock_key="{key}", lock_ttl=TTL, max_retries=0)(
        _hold
    )
    for i in range(HOLDERS)
]


def send_calls(calls: list[dict[str, Any]]) -> None:
    """Send each call (``actor``, ``args``, ``kwargs``, ``options``, then a ``pause`` in seconds), recording the
    instant just before each send in the list ``sent``; one pipeline of records for the lot."""
    every: list[dramatiq.Actor[Any, Any]] = [job, policy, invoice, revision, *holders]
    actors = {a.actor_name: a for a in every}
    sent = []
    for call in calls:
        at = time.time()
        message = actors[call["actor"]].send_with_options(
            args=tuple(call.get("args", ())), kwargs=call.get("kwargs", {}), **call.get("options", {})
        )
        sent.append(json.dumps({"message_id": message.message_id, "at": at, "args": call.get("args", [])}))
        if call.get("pause"):
            time.sleep(call["pause"])
    pipe = record.pipeline(transaction=False)
    for item in sent:
        pipe.rpush("sent", item)
    pipe.execute()
