"""The public API: what docs/api.md lists is what the package exports, one error hierarchy, the ``with`` form.

The reference's generated part is rendered from the exports, their signatures and docstrings by
``python -m tools.apidoc``; a change to the public API that the reference does not show fails here.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import redis

import dramatiq_leases
from dramatiq_leases import (
    Busy,
    Heartbeat,
    Lease,
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseExpiredError,
    LeaseLost,
    Leases,
    LeaseStateError,
    LeaseURLError,
    LostReason,
)
from dramatiq_leases.web import LockedError
from tools import apidoc

from .support.waiting import wait_for


def test_the_reference_lists_exactly_what_the_package_exports() -> None:
    assert apidoc.current() == apidoc.rewritten(), "docs/api.md is stale: run `python -m tools.apidoc`"
    listed = {line[5:-1] for line in apidoc.current().splitlines() if line.startswith("### `")}
    exported = {f"{m}.{n}" for m in apidoc.PUBLIC_MODULES for n in importlib.import_module(m).__all__}
    assert listed == exported


def test_every_public_name_and_member_has_a_docstring() -> None:
    missing = []
    for module_name in apidoc.PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if name == "__version__" or not (inspect.isclass(obj) or callable(obj)):
                continue
            if not inspect.getdoc(obj):
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                for member, value in apidoc.public_members(obj):
                    function = getattr(value, "__func__", value)
                    if (callable(function) or isinstance(value, property)) and not inspect.getdoc(function):
                        missing.append(f"{module_name}.{name}.{member}")
    assert missing == []


def test_every_error_is_a_lease_error_and_lease_lost_is_an_interruption() -> None:
    exceptions = [
        obj
        for m in apidoc.PUBLIC_MODULES
        for n in importlib.import_module(m).__all__
        if inspect.isclass(obj := getattr(importlib.import_module(m), n)) and issubclass(obj, BaseException)
    ]
    assert LockedError in exceptions and LeaseBusyError in exceptions
    outside = [e.__name__ for e in exceptions if not issubclass(e, LeaseError)]
    # RateLimited is not an error of ours: an actor raises it to say its downstream rate-limited it.
    assert outside == ["LeaderLost", "LeaseLost", "RateLimited"]
    # An actor's `except Exception` must not swallow it and run on without its lease; nor a scheduler loop's,
    # and schedule beside the new leader.
    assert not issubclass(LeaseLost, Exception) and not issubclass(dramatiq_leases.LeaderLost, Exception)


def test_the_with_form_holds_the_key_for_the_block_and_releases_it(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    with leases.lease("export:1", ttl=10_000) as lease:
        assert isinstance(lease, Lease) and lease.fence > 0
        with pytest.raises(LeaseBusyError) as busy, leases.lease("export:1", ttl=10_000):
            pass
        assert isinstance(busy.value.busy, Busy) and busy.value.key == "export:1"
        assert busy.value.busy.retry_after >= 1
    assert leases.inspect("export:1") is None  # released by its owner at the block's end
    assert leases.fence_state("export:1")["released"] == lease.fence


def test_the_with_form_releases_when_the_block_raises(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    with pytest.raises(RuntimeError, match="export failed"), leases.lease("export:2", ttl=10_000):
        raise RuntimeError("export failed")
    assert leases.inspect("export:2") is None


def test_the_with_form_with_a_heartbeat_outlives_its_ttl_and_reports_a_loss(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    heartbeat = Heartbeat(leases)
    heartbeat.start()
    lost: list[LostReason] = []
    try:
        with (
            pytest.raises(LeaseExpiredError),
            leases.lease("export:3", ttl=600, heartbeat=heartbeat, on_lost=lambda _, r: lost.append(r)) as lease,
        ):
            granted = lease.fence

            # Held past three TTLs: only renewals can keep it (one grant: the fence stays).
            def renewed_past_three_ttls() -> bool:
                info = leases.inspect("export:3")
                assert info is not None and info.fence == granted
                return info.renewed_ms - info.acquired_ms > 3 * 600

            wait_for(renewed_past_three_ttls, timeout=20, what="renewals to keep it past three TTLs")
            redis_client.delete(leases.lease_name("export:3"))  # taken away behind its back
            wait_for(lambda: lost, timeout=10, what="the heartbeat to report the loss")
            assert lease.remaining() == 0  # the block can tell at once
        assert lost == [LostReason.GONE]
        assert heartbeat.tracked() == []
    finally:
        heartbeat.stop()


def test_the_top_level_names_are_importable_without_dramatiq_worker_machinery() -> None:
    # The middleware's names load on first use (a web app that only takes leases never imports them).
    assert set(dramatiq_leases.__all__) >= {"LeaseMiddleware", "current_lease", "Leases", "LeaseError"}
    for name in dramatiq_leases.__all__:
        assert getattr(dramatiq_leases, name) is not None


def test_the_with_form_says_when_its_lease_ended_before_the_block(redis_client: redis.Redis) -> None:
    """A block that outlived its lease (expired, then taken) learns it at its end: its work may have overlapped."""
    leases = Leases(redis_client)
    with pytest.raises(LeaseExpiredError) as ended, leases.lease("export:4", ttl=200) as lease:
        wait_for(lambda: leases.try_acquire("export:4", ttl=10_000) or None, what="another owner to take it")
        assert lease.remaining() == 0
    assert ended.value.lease is lease and ended.value.key == "export:4"


def test_the_with_form_releases_a_grant_an_interruption_cut_short(redis_client: redis.Redis) -> None:
    """The token is chosen before Redis is asked: an interruption right after the grant still releases it."""
    leases = Leases(redis_client)
    real = leases.try_acquire

    def granted_then_interrupted(*args: Any, **kwargs: Any) -> Lease | Busy:
        real(*args, **kwargs)
        raise KeyboardInterrupt

    leases.try_acquire = granted_then_interrupted  # type: ignore[method-assign]  # the interruption's instant
    with pytest.raises(KeyboardInterrupt), leases.lease("export:5", ttl=60_000):
        pass
    assert leases.inspect("export:5") is None


def test_on_lost_without_a_heartbeat_is_refused(redis_client: redis.Redis) -> None:
    leases = Leases(redis_client)
    with (
        pytest.raises(LeaseConfigError, match="on_lost is called by a heartbeat"),
        leases.lease("export:6", ttl=1_000, on_lost=lambda lease, reason: None),
    ):
        pass
    assert leases.inspect("export:6") is None  # refused before Redis was asked


def test_a_bad_url_and_a_lease_asked_outside_an_actor_are_lease_errors() -> None:
    """What users meet most often outside Redis itself: still caught by ``except LeaseError``, and by the
    ``ValueError`` / ``RuntimeError`` clauses they may already have."""
    with pytest.raises(LeaseURLError, match="only database 0") as bad:
        Leases.from_url("redis+cluster://user:secret@127.0.0.1:1/3")
    assert isinstance(bad.value, ValueError) and "secret" not in str(bad.value)
    with pytest.raises(LeaseStateError, match="outside an actor") as outside:
        dramatiq_leases.current_lease()
    assert isinstance(outside.value, RuntimeError)
