"""How a message waits for its busy key: in place near the head of the line, parked further back.

See :mod:`dramatiq_leases.core.line` for the line itself. A worker process
keeps here what only it can know: which of its threads wait in place (at most
half of them; more for the heads of lines while a thread is left free), which
run actors, and which parked copies its delay-queue consumers hold. A
parked copy is an ordinary delayed message, so the broker stays its home: if
the process dies, the broker hands the copy to another, which registers it.
Asked back (a promotion on this process's channel, or found so by the check
every :data:`TEND_INTERVAL`), the copy is taken out of Dramatiq's delay queue
and sent to its queue at once, as Dramatiq itself does when an ``eta`` passes:
enqueue the message, then acknowledge the delayed copy. Its ``eta`` is kept
here too, and the copy is sent on the same way at that instant, to the
millisecond: Dramatiq looks at its delay queues only between two fetches of
their consumer, which back off to ``worker_timeout`` (1 s by default) when
idle, and a copy parked until its key's rate allows one more start
(``lock_rate``) is asked back by no one else, so it would start up to that
much late.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.common import current_millis, q_name
from dramatiq.worker import ConsumerThread

from ..core.lease import Busy
from ..core.line import DEFAULT_PARK_MS
from ..core.store import Leases
from .options import ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION

logger = logging.getLogger(__name__)

#: Message option of a parked copy: the lease key it waits for.
LINE_OPTION = "lease_line"

#: How often a process checks the places of the copies it holds parked (s):
#: a promotion missed on the channel is acted on within this time.
TEND_INTERVAL = 5.0

#: The longest one delivery waits in place (s) before it parks instead; a
#: quarter of the message's time limit if that is shorter (TimeLimit counts
#: this wait).
MAX_IN_PLACE = 60.0

# Set while this module sends a parked copy on (a thread of its own, never a worker's).
_sending_on = threading.local()


def moving_on() -> bool:
    """Whether this thread's enqueue is a delayed copy moving on to its queue: sent on here, or by Dramatiq's
    consumer threads, which enqueue nothing else. The broker may hand it out, run it and acknowledge it before
    the enqueue returns: what must hold before that is done before the enqueue."""
    return getattr(_sending_on, "active", False) or isinstance(threading.current_thread(), ConsumerThread)


def waiter_id(message: Any) -> str:
    """A message's id in the line: its id and retry count (a retry is a new waiter; a copy is not)."""
    return f"{message.message_id}:{message.options.get('retries', 0)}"


#: How many times a parked copy is looked for in its delay queue, once per promotion or check, before its
#: registration is dropped: a promotion can arrive between the copy's registration and Dramatiq's put.
MAX_MISSES = 3

#: How soon a copy whose eta came is looked for again when it was not in its delay queue yet (s): registered
#: in ``before_delay_message``, it is put there just after.
RETAKE_DELAY = 0.01


class _Parked:
    __slots__ = ("consumer", "key", "misses", "proxy")

    def __init__(self, consumer: Any, proxy: Any, key: str) -> None:
        self.consumer = consumer
        self.proxy = proxy
        self.key = key
        self.misses = 0


class Waiting:
    """The waits of one worker process.

    Parameters:
      leases: the lease store (its lines).
      on_drop: called with a parked copy taken out of a delay queue and acknowledged without being sent on.
    """

    def __init__(self, leases: Leases, on_drop: Callable[[Any], None] | None = None) -> None:
        self.leases = leases
        self.on_drop = on_drop
        self.channel = ""
        self.cap = 1
        self.front_cap = 1
        self.threads = 1
        # Waiter -> its parked copies held here: usually one; two when an enqueue was tried again.
        self._parked: dict[str, list[_Parked]] = {}
        self._in_place: dict[int, tuple[str, str]] = {}
        # The worker threads whose message went on to run its actor, until they are done with it.
        self._running: dict[int, bool] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._broker: dramatiq.Broker | None = None
        # The etas of the copies held here, soonest first: (eta in epoch ms, tie-break, waiter, copy). The copy
        # by a weak reference: one promoted or dropped meanwhile is not kept in memory until its eta.
        self._due: list[tuple[float, int, str, weakref.ref[Any]]] = []
        self._due_changed = threading.Condition()
        self._due_order = itertools.count()

    # Lifecycle ---------------------------------------------------------------

    def prepare(self) -> None:
        """Name this process's promotion channel; call it before the worker's consumers start.

        Dramatiq starts the consumers, and the worker threads, before any ``after_worker_boot``
        hook runs: a parked copy that a delay-queue consumer receives in between (one left in the
        broker by a worker that stopped or died, or parked by another process meanwhile) is
        registered with its line under this channel. Without one it would not be, and nothing
        would look at it again before its ``eta``. A promotion published before :meth:`boot`
        subscribes is not missed: the listener checks every registered copy once subscribed.
        """
        # No whitespace: waiter entries are space-separated (a prefix may contain spaces).
        self.channel = "".join(f"{self.leases.prefix}:promote:{uuid.uuid4().hex}".split())

    def boot(self, broker: dramatiq.Broker, worker_threads: int) -> None:
        """Start listening for promotions; at most half the worker threads may wait in place (see :meth:`reserve`)."""
        self._broker = broker
        self.threads = worker_threads
        self.cap = max(1, worker_threads // 2)
        # The front of a line (the next to run) may take more, short of the last free thread (see reserve).
        self.front_cap = max(self.cap, worker_threads - 1)
        if not self.channel:
            self.prepare()
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._listen, name="dramatiq-leases-line-listener", daemon=True),
            threading.Thread(target=self._tend_loop, name="dramatiq-leases-line-tender", daemon=True),
            threading.Thread(target=self._due_loop, name="dramatiq-leases-line-timer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def shutdown(self) -> None:
        """Wake the threads waiting in place (they park their messages) and stop listening."""
        self._stop.set()
        with self._due_changed:
            self._due_changed.notify_all()
        for key, waiter in list(self._in_place.values()):
            try:
                self.leases.line.wake(key, waiter)
            except Exception as e:
                logger.warning("Could not wake a waiter of %r at shutdown: %s", key, e)

    @property
    def in_place(self) -> int:
        """How many threads of this process hold a place to wait in place now."""
        return len(self._in_place)

    @property
    def parked(self) -> int:
        """How many parked copies this process's delay queues hold (registered with their lines)."""
        return sum(len(copies) for copies in list(self._parked.values()))

    @property
    def stopping(self) -> bool:
        """Whether this process is shutting down (nothing new waits in place)."""
        return self._stop.is_set()

    # Worker threads ------------------------------------------------------------

    def running(self) -> None:
        """This worker thread goes on to run its message's actor: busy until :meth:`done_with_message`."""
        self._running[threading.get_ident()] = True

    def done_with_message(self) -> None:
        """This worker thread is done with its message: free for the next one."""
        self._running.pop(threading.get_ident(), None)
        self._in_place.pop(threading.get_ident(), None)

    def reserve(self, key: str, waiter: str, *, front: bool = False) -> bool:
        """Take one of this process's places to wait in place for this thread; ``False`` if none is free.

        ``front``: the waiter is among the next to run (its line said so): it may take a place past half the
        threads, rather than park and leave a slot idle until its copy comes back, if that leaves a thread of
        this process neither running an actor nor waiting in place (messages of other keys it has taken from
        the broker would wait behind them otherwise).

        Lock-free, for worker threads: the insert and the removal are single
        operations, so an interruption leaves at worst this thread's own
        entry, which :meth:`done_with_message` drops. Two
        threads racing may both back off, never both exceed the cap.
        """
        if self._stop.is_set():
            return False
        thread_id = threading.get_ident()
        self._in_place[thread_id] = (key, waiter)
        taken = len(self._in_place)
        if taken > (self.front_cap if front else self.cap) or (
            taken > self.cap and len(self._running.keys() | self._in_place.keys()) >= self.threads
        ):
            self._in_place.pop(thread_id, None)
            return False
        return True

    def wait_in_place(self, key: str, waiter: str, block_ms: int) -> None:
        """Block this worker thread (holding a place, see :meth:`reserve`) until woken or ``block_ms`` passed."""
        self.leases.line.wait_turn(key, waiter, block_ms)

    def forget_thread(self) -> None:
        """Give back this thread's place to wait in place, if it holds one."""
        self._in_place.pop(threading.get_ident(), None)

    @staticmethod
    def parked_copy(
        message: Any, key: str, busy: Busy, first_ms: int, max_wait: int | None, *, back_ms: int | None = None
    ) -> tuple[Any, int]:
        """The copy of ``message`` to park in the delay queue for its waiter, and its delay (ms): back by
        ``back_ms`` at the latest, if given."""
        delay = DEFAULT_PARK_MS if back_ms is None else max(1, min(DEFAULT_PARK_MS, back_ms))
        if max_wait is not None:
            # Back at the end of the wait budget at the latest, to give up in time.
            delay = max(1, min(delay, first_ms + max_wait - busy.now_ms))
        attempts = int(message.options.get(ATTEMPTS_OPTION, 0)) + 1
        options = {ATTEMPTS_OPTION: attempts, FIRST_ATTEMPT_OPTION: first_ms, LINE_OPTION: key}
        return message.copy(options=options), delay

    # Delay-queue consumers -----------------------------------------------------

    def on_delay(self, message: Any) -> None:
        """A parked copy reached this process's delay queue: register it, or send it back at once."""
        key = message.options.get(LINE_OPTION)
        if not isinstance(key, str) or not self.channel:
            return
        waiter = waiter_id(message)
        try:
            [state] = self.leases.line.hold(key, [waiter], self.channel)
        except Exception as e:
            logger.warning(
                "Could not register the parked copy of message %s: %s; it comes back by itself.", message.message_id, e
            )
            return
        if state in ("p", "r"):
            self._parked.setdefault(waiter, []).append(_Parked(threading.current_thread(), message, key))
            eta = message.options.get("eta")
            if isinstance(eta, (int, float)) and not isinstance(eta, bool):
                self._arm(float(eta), waiter, message)
        else:
            message.options["eta"] = current_millis()  # read by Dramatiq right after this hook: back at once

    def on_enqueue(self, message: Any) -> None:
        """A parked copy leaves the delay queue by itself (its ``eta`` passed): it is no longer held here.

        Only that copy is forgotten: Dramatiq's consumer thread has just taken it out of its delay queue.
        A spare of the same waiter, still in a delay queue, stays registered (forgotten too, it would sit
        there unacknowledged until its own eta); so does every copy when the enqueue is our own send-on.
        """
        if LINE_OPTION not in message.options or "eta" in message.options:
            return
        waiter = waiter_id(message)
        copies = self._parked.get(waiter)
        if not copies:
            return
        thread = threading.current_thread()
        kept = [p for p in copies if p.consumer is not thread or _holds(p)]
        if self._parked.get(waiter) is copies:  # not taken meanwhile by unpark in another thread
            if kept:
                self._parked[waiter] = kept
            else:
                self._parked.pop(waiter, None)

    def unpark(self, waiter: str, *, drop: bool = False) -> bool:
        """Send a parked copy of ``waiter`` held here to its queue now; ``False`` if none was sent.

        Any other copy of it held here is a spare (an enqueue tried again after an interruption or a
        timeout): it is only acknowledged. With ``drop`` (the waiter already ran) every copy is: sent
        on, it would be dropped as a duplicate anyway, at the cost of an enqueue and a delivery.
        """
        copies = self._parked.pop(waiter, None)
        if not copies or self._broker is None:
            return False
        sent = False
        kept: list[_Parked] = []
        for parked in copies:
            delay_queue = getattr(parked.consumer, "delay_queue", None)
            item = None if delay_queue is None else _take(delay_queue, parked.proxy)
            if delay_queue is None or item is None:
                # Not yet put there (registered in before_delay_message, put just after), or already on its
                # way back (then on_enqueue forgets it): kept for the next check, a bounded number of times.
                parked.misses += 1
                if delay_queue is not None and parked.misses < MAX_MISSES:
                    kept.append(parked)
            elif drop or sent:
                if self.on_drop is not None:
                    self.on_drop(parked.proxy)
                parked.consumer.post_process_message(parked.proxy)
                delay_queue.task_done()
            elif self._send_on(parked, item, delay_queue):
                sent = True
            else:
                kept.append(parked)
        if kept:
            self._parked.setdefault(waiter, []).extend(kept)
        return sent

    def _send_on(self, parked: _Parked, item: Any, delay_queue: Any) -> bool:
        """Enqueue a parked copy taken out of its delay queue, then acknowledge it, as Dramatiq does at its eta."""
        assert self._broker is not None
        fresh = parked.proxy.copy(queue_name=q_name(parked.proxy.queue_name))
        fresh.options.pop("eta", None)
        try:
            _sending_on.active = True
            self._broker.enqueue(fresh)
        except Exception as e:
            logger.warning(
                "Could not send the parked copy of message %s back: %s; it comes back by itself.",
                parked.proxy.message_id,
                e,
            )
            delay_queue.put(item)
            delay_queue.task_done()
            return False
        finally:
            _sending_on.active = False
        parked.consumer.post_process_message(parked.proxy)
        delay_queue.task_done()
        return True

    # Heartbeat-like threads ---------------------------------------------------------

    def _listen(self) -> None:
        connected = True  # one WARNING per outage, not one per reconnection attempt
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self.leases.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                connected = True
                self.tend()  # whatever was missed while not subscribed
                while not self._stop.is_set():
                    event = pubsub.get_message(timeout=1.0)
                    if event is not None and event.get("type") == "message":
                        data = event["data"]
                        self.unpark(data.decode() if isinstance(data, bytes) else str(data))
            except Exception as e:
                if not self._stop.is_set():
                    logger.log(
                        logging.WARNING if connected else logging.DEBUG,
                        "Line listener lost its connection (%s); reconnecting.",
                        e,
                    )
                    connected = False
                    self._stop.wait(0.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()

    def _arm(self, eta_ms: float, waiter: str, proxy: Any) -> None:
        """Send ``waiter``'s parked copy ``proxy`` on at ``eta_ms`` (epoch ms), unless it left before."""
        with self._due_changed:
            heapq.heappush(self._due, (eta_ms, next(self._due_order), waiter, weakref.ref(proxy)))
            if self._due[0][3]() is proxy:  # sooner than what the timer sleeps for
                self._due_changed.notify()

    def _due_loop(self) -> None:
        """Send on each parked copy held here at its eta (no Redis call: an enqueue and an ack, at that instant)."""
        while True:
            with self._due_changed:
                if self._stop.is_set():  # read under the lock :meth:`shutdown` notifies under: no wake-up missed
                    return
                now = current_millis()
                due: list[tuple[str, Any]] = []
                while self._due and self._due[0][0] <= now:
                    _, _, waiter, ref = heapq.heappop(self._due)
                    proxy = ref()
                    if proxy is not None:
                        due.append((waiter, proxy))
                if not due:
                    wait = (self._due[0][0] - now) / 1000 if self._due else None
                    self._due_changed.wait(wait)
                    continue
            for waiter, proxy in due:
                try:
                    self._send_due(waiter, proxy)
                except Exception as e:
                    logger.warning("Could not send a parked copy on at its eta: %s; it comes back by itself.", e)

    def _send_due(self, waiter: str, proxy: Any) -> None:
        """``proxy``'s eta came: send it on, if this process still holds it (promoted, dropped or moved by Dramatiq
        meanwhile, it is gone); not found in its delay queue yet, look again shortly (a bounded number of times)."""
        copies = self._parked.get(waiter)
        if not copies or not any(p.proxy is proxy for p in copies):
            return
        if self.unpark(waiter):
            return
        if any(p.proxy is proxy for p in self._parked.get(waiter, [])):  # kept for another look
            self._arm(current_millis() + RETAKE_DELAY * 1000, waiter, proxy)

    def _tend_loop(self) -> None:
        while not self._stop.wait(TEND_INTERVAL):
            try:
                self.tend()
            except Exception as e:
                logger.warning("Could not check the parked copies of this process: %s", e)

    def tend(self) -> None:
        """Check every parked copy held here; send back those whose turn came, that ran, or that lost their place."""
        by_key: dict[str, list[str]] = defaultdict(list)
        for waiter, copies in list(self._parked.items()):
            by_key[copies[0].key].append(waiter)
        for key, waiters in by_key.items():
            states = self.leases.line.hold(key, waiters, self.channel)
            for waiter, state in zip(waiters, states):
                if state in ("m", "x", "d", "s"):
                    self.unpark(waiter, drop=state == "d")


def _holds(parked: _Parked) -> bool:
    """Whether ``parked``'s copy is still in its consumer's delay queue."""
    delay_queue = getattr(parked.consumer, "delay_queue", None)
    if delay_queue is None:
        return False
    with delay_queue.mutex:
        return any(getattr(item, "message", None) is parked.proxy for item in delay_queue.queue)


def _take(delay_queue: Any, proxy: Any) -> Any:
    """Take the item holding ``proxy`` out of a consumer's delay queue; ``None`` if it is not there."""
    for _ in range(5):  # Dramatiq takes an item out for a moment to look at its eta
        with delay_queue.mutex:
            for i, candidate in enumerate(delay_queue.queue):
                if getattr(candidate, "message", None) is proxy:
                    item = delay_queue.queue.pop(i)
                    heapq.heapify(delay_queue.queue)
                    return item
        time.sleep(0.002)
    return None
