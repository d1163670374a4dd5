"""Recording and alerting rules, rendered from a :class:`~.config.MixinConfig`.

Why each alert is what it is, briefly (the runbook, ``docs/runbook.md``, says
what to do):

* Only what affects users pages (``severity: critical``): a leak that never
  ends by itself (``no_ttl``) or that messages of its actor are waiting on,
  a safety or liveness error budget burning fast, very slow acquisitions.
  A leak of a dead holder ends at its TTL by itself: a warning.
* Nothing is blind without saying so: an exporter that is down or never
  completes a scan, and a worker target whose lease series are missing, warn.
* Worker aggregations keep the cluster label and ``job``; exporter gauges
  use ``max``, not ``sum``, so two exporters (a rollout) do not double them.
* Recording rules follow ``level:metric:operations``; ``job_actor`` keeps
  (cluster, job, actor_name, queue_name), ``actor`` keeps (cluster,
  actor_name, queue_name) where worker and exporter series are combined.
"""

from __future__ import annotations

from typing import Any

from .config import MixinConfig

#: Multi-window burn-rate pairs (the SRE workbook's, as kubernetes-mixin uses them): severity, long and
#: short window, burn factor, for.
BURN_RATES = (
    ("critical", "1h", "5m", 14.4, "2m"),
    ("critical", "6h", "30m", 6.0, "15m"),
    ("warning", "1d", "2h", 3.0, "1h"),
    ("warning", "3d", "6h", 1.0, "3h"),
)
#: Seconds in each long window (rate x seconds = events in the window).
WINDOW_SECONDS = {"1h": 3600, "6h": 21600, "1d": 86400, "3d": 259200}
#: Every window the burn-rate pairs read.
SLO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")

Rule = dict[str, Any]

_NOT_ERROR = 'outcome!="error"'
_ACQUIRED = 'outcome="acquired"'
_ERROR = 'outcome="error"'
_LEAKED = 'reason=~"holder_dead|past_max_hold|no_ttl"'
_NO_TTL = 'reason="no_ttl"'
_ENDS_BY_TTL = 'reason=~"holder_dead|past_max_hold"'


def _sel(*matchers: str) -> str:
    return "{" + ", ".join(m for m in matchers if m) + "}"


def _on(cfg: MixinConfig, *labels: str) -> str:
    return ", ".join([*cfg.cluster, *labels])


def recording_rules(cfg: MixinConfig) -> list[Rule]:
    """Rules the alerts and the dashboard share."""
    w, by, actor = cfg.worker_selector, cfg.by, _on(cfg, "actor_name", "queue_name")
    rules: list[Rule] = [
        {
            "record": "job_actor:dramatiq_lease_acquire_duration_seconds_bucket:rate5m",
            "expr": f"sum by ({by}, le) "
            f"(rate(dramatiq_lease_acquire_duration_seconds_bucket{_sel(w, _NOT_ERROR)}[5m]))",
        },
        {
            "record": "job_actor:dramatiq_lease_acquire_attempts:rate5m",
            "expr": f"sum by ({by}) (rate(dramatiq_lease_acquire_duration_seconds_count{_sel(w, _NOT_ERROR)}[5m]))",
        },
    ]
    for window in SLO_WINDOWS:
        grants = f"sum by ({actor}) (rate(dramatiq_lease_acquire_duration_seconds_count{_sel(w, _ACQUIRED)}[{window}]))"
        lost = f"sum by ({actor}) (rate(dramatiq_lease_lost_total{_sel(w)}[{window}]))"
        expired = f"max by ({actor}) (rate(dramatiq_lease_expired_total{_sel(cfg.exporter_selector)}[{window}]))"
        gave_up = f"sum by ({actor}) (rate(dramatiq_lease_gave_up_total{_sel(w)}[{window}]))"
        rules += [
            {"record": f"actor:dramatiq_lease_grants:rate{window}", "expr": grants},
            {
                # Grants that ended without their holder's release. A lease a worker lost is not released,
                # so the exporter counts it as expired too: the larger of the two counts each grant once
                # (expired alone when the holder crashed and could not say).
                "record": f"actor:dramatiq_lease_unsafe_ends:rate{window}",
                "expr": f"({lost} > {expired})\nor {expired}\nor {lost}",
            },
            {"record": f"actor:dramatiq_lease_gave_up:rate{window}", "expr": gave_up},
            {
                # Per grant; no series without grants (rather than +Inf): the event alerts cover those.
                "record": f"actor:dramatiq_lease_unsafe_ends_per_grant:ratio_rate{window}",
                "expr": f"actor:dramatiq_lease_unsafe_ends:rate{window}\n"
                f"/ (actor:dramatiq_lease_grants:rate{window} > 0)",
            },
            {
                # Messages that gave up waiting, per message that finished waiting (granted or gave up).
                "record": f"actor:dramatiq_lease_gave_up_per_message:ratio_rate{window}",
                "expr": f"actor:dramatiq_lease_gave_up:rate{window}\n/ (((actor:dramatiq_lease_grants:rate{window}"
                f" + actor:dramatiq_lease_gave_up:rate{window}) or actor:dramatiq_lease_gave_up:rate{window}) > 0)",
            },
        ]
    return rules


def _annotations(cfg: MixinConfig, alert: str, summary: str, description: str, actor: bool = True) -> dict[str, str]:
    out = {
        "summary": summary,
        "description": description,
        "runbook_url": cfg.runbook_url.replace("{alert}", alert.lower()),
    }
    if actor:
        link = cfg.dashboard_url + "?var-actor={{ $labels.actor_name }}"
        if cfg.cluster_label:
            link += f"&var-cluster={{{{ $labels.{cfg.cluster_label} }}}}"
        out["dashboard_url"] = link
    else:
        out["dashboard_url"] = cfg.dashboard_url
    return out


def _alert(
    name: str, expr: str, for_: str, severity: str, annotations: dict[str, str], *, extra: dict[str, str] | None = None
) -> Rule:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity, **(extra or {})},
        "annotations": annotations,
    }


def alert_rules(cfg: MixinConfig) -> list[Rule]:
    """Every alert, in the order of the runbook."""
    w, e, by = cfg.worker_selector, cfg.exporter_selector, cfg.by
    where = "of actor {{ $labels.actor_name }} on queue {{ $labels.queue_name }}"
    leaked = f"max by ({by}, reason) (dramatiq_lease_leaked{_sel(e, _LEAKED)}) > 0"
    # Users are affected when messages wait in the line of the leaked key itself (the exporter counts them
    # per leaked lease), not merely somewhere on the same actor.
    waiting_on = (
        f"{leaked}\nand on ({by}, reason)\nmax by ({by}, reason) (dramatiq_lease_leaked_waiting{_sel(e, _LEAKED)}) > 0"
    )
    leak_text = (
        "{{ $value }} lease(s) " + where + " are leaked ({{ $labels.reason }}): still in Redis, but no "
        "holder can release them."
    )
    latency = (
        "histogram_quantile(0.99, sum by ({by}, le) (job_actor:dramatiq_lease_acquire_duration_seconds_bucket:rate5m))"
    )
    latency = latency.format(by=by)
    traffic = f"and on ({by}) job_actor:dramatiq_lease_acquire_attempts:rate5m >= {cfg.acquire_latency_min_rate:g}"
    latency_text = "99th percentile lease acquire latency " + where + " is {{ $value | humanizeDuration }}."
    stale = (
        f"time() - max by ({_on(cfg, 'job', 'instance')})"
        f" (dramatiq_lease_exporter_last_scan_timestamp_seconds{_sel(e)})"
    )
    exporter_down = f"up{_sel(e)} == 0\nor\nabsent(up{_sel(e)})"
    if cfg.cluster_label:
        # absent() has no labels: a cluster whose workers are scraped but whose exporter target is gone.
        c = cfg.cluster_label
        has_cluster = c + '!=""'
        exporter_down += (
            f"\nor\n(group by ({c}) (up{_sel(w, has_cluster)}) unless on ({c}) group by ({c}) (up{_sel(e)}))"
        )
    rules = [
        _alert(
            "DramatiqLeaseLeaked",
            f"max by ({by}, reason) (dramatiq_lease_leaked{_sel(e, _NO_TTL)}) > 0\nor\n{waiting_on}",
            cfg.leak_for,
            "critical",
            _annotations(
                cfg,
                "DramatiqLeaseLeaked",
                "Leaked leases are blocking messages that are waiting for them.",
                leak_text + " Either a key has no TTL (it never frees by itself) or messages are waiting in its line.",
            ),
        ),
        _alert(
            "DramatiqLeaseLeaked",
            f"max by ({by}, reason) (dramatiq_lease_leaked{_sel(e, _ENDS_BY_TTL)}) > 0",
            cfg.leak_for,
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseLeaked",
                "Leases in Redis that no holder can release.",
                leak_text + " Each ends at its TTL by itself (critical instead while messages wait on them).",
            ),
        ),
        _alert(
            "DramatiqLeaseHeartbeatOverdue",
            f"max by ({by}) (dramatiq_lease_heartbeat_overdue{_sel(e)}) > 0",
            "1m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseHeartbeatOverdue",
                "Lease heartbeats are overdue; their holders may still be running.",
                "{{ $value }} lease(s) " + where + " are not being renewed on time, and have been for a minute. "
                "Their holders may still be running under them, so do not release them by hand: each ends by "
                "its TTL if its holder is gone.",
            ),
        ),
        _alert(
            "DramatiqLeaseLost",
            f"sum by ({by}, reason) (increase(dramatiq_lease_lost_total{_sel(w)}[10m])) > 0",
            "1m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseLost",
                "Workers lost leases while still running the guarded work.",
                "Workers lost about {{ $value | humanize }} lease(s) " + where + " in the last 10 minutes "
                "(reason: {{ $labels.reason }}).",
            ),
        ),
        _alert(
            "DramatiqLeaseRenewalErrors",
            f"sum by ({by}) (rate(dramatiq_lease_renewals_total{_sel(w, _ERROR)}[5m]))\n"
            f"/\nsum by ({by}) (rate(dramatiq_lease_renewals_total{_sel(w)}[5m]))\n> 0.05",
            "5m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseRenewalErrors",
                "Lease renewals are failing.",
                "{{ $value | humanizePercentage }} of lease renewals " + where + " failed over the last "
                "5 minutes; a lease not renewed before its TTL runs out is lost.",
            ),
        ),
        _alert(
            "DramatiqLeaseBusyRetriesHigh",
            f"sum by ({by}) (rate(dramatiq_lease_busy_retries_total{_sel(w)}[10m]))\n"
            f"/\nsum by ({by}) (rate(dramatiq_lease_acquire_duration_seconds_count{_sel(w)}[10m]))\n> 0.5",
            "15m",
            "info",
            _annotations(
                cfg,
                "DramatiqLeaseBusyRetriesHigh",
                "Most lease acquisitions find the lease busy.",
                "{{ $value | humanizePercentage }} of lease acquire attempts " + where + " found the lease busy "
                "over the last 10 minutes.",
            ),
        ),
        _alert(
            "DramatiqLeaseAcquireLatencyHigh",
            f"{latency} > {cfg.acquire_latency_warning_seconds:g}\n{traffic}",
            "10m",
            "warning",
            _annotations(cfg, "DramatiqLeaseAcquireLatencyHigh", "Lease acquisition is slow.", latency_text),
        ),
        _alert(
            "DramatiqLeaseAcquireLatencyHigh",
            f"{latency} > {cfg.acquire_latency_critical_seconds:g}\n{traffic}",
            "5m",
            "critical",
            _annotations(cfg, "DramatiqLeaseAcquireLatencyHigh", "Lease acquisition is very slow.", latency_text),
        ),
        _alert(
            "DramatiqLeaseGaveUp",
            f"sum by ({by}) (increase(dramatiq_lease_gave_up_total{_sel(w)}[15m])) > 0",
            "1m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseGaveUp",
                "Messages gave up waiting for their lease.",
                "About {{ $value | humanize }} message(s) " + where + " exhausted their lease wait budget in the "
                "last 15 minutes and were given up without running.",
            ),
        ),
        _alert(
            "DramatiqLeaseRedisErrors",
            # Workers and the exporter (scan) both count them; other teams' jobs must not alert here.
            f"sum by ({_on(cfg, 'job', 'operation')}) (\n"
            f"  increase(dramatiq_lease_redis_errors_total{_sel(w)}[10m])\n"
            f"  or increase(dramatiq_lease_redis_errors_total{_sel(e)}[10m])\n"
            f") >= {cfg.redis_errors}",
            "5m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseRedisErrors",
                "Lease operations are failing against Redis.",
                "Job {{ $labels.job }} had {{ $value | humanize }} Redis errors on lease {{ $labels.operation }} "
                "operations in the last 10 minutes.",
                actor=False,
            ),
        ),
        _alert(
            "DramatiqLeaseExporterDown",
            exporter_down,
            "5m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseExporterDown",
                "The dramatiq-leases exporter is down.",
                "No dramatiq-leases exporter has been scraped successfully for 5 minutes "
                "{{ with $labels.instance }}(instance {{ . }}){{ else }}(no target at all){{ end }}; "
                "leaked, present and expired leases are not being measured.",
                actor=False,
            ),
        ),
        _alert(
            "DramatiqLeaseExporterStale",
            f"{stale} > {cfg.exporter_stale_seconds}",
            "1m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseExporterStale",
                "The dramatiq-leases exporter is not scanning Redis.",
                "The dramatiq-leases exporter {{ $labels.instance }} has not completed a Redis scan for "
                "{{ $value | humanizeDuration }} (since it started, if it never did); lease gauges and the "
                "leak alert are blind or stale.",
                actor=False,
            ),
        ),
        # A blind spot must not be silent: masters the exporter cannot read, keys it cannot read as leases.
        _alert(
            "DramatiqLeaseExporterBlindSpot",
            f"max by ({_on(cfg, 'job', 'instance')}) (dramatiq_lease_exporter_unreachable_nodes{_sel(e)}) > 0",
            "5m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseExporterBlindSpot",
                "Redis Cluster masters do not answer the dramatiq-leases exporter: their leases are not measured.",
                "{{ $value }} Redis Cluster master(s) have not answered the scans of the dramatiq-leases exporter "
                "{{ $labels.instance }} for 5 minutes: leaks and leases held there are missing from its figures "
                "and cannot alert. Its log and its /leases page name them.",
                actor=False,
            ),
        ),
        _alert(
            "DramatiqLeaseExporterBlindSpot",
            f"max by ({_on(cfg, 'job', 'instance', 'kind')}) (dramatiq_lease_exporter_unreadable_keys{_sel(e)}) > 0",
            "15m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseExporterBlindSpot",
                "Redis keys under the lease prefix are not of the type their name says.",
                "{{ $value }} {{ $labels.kind }} key(s) seen by the dramatiq-leases exporter {{ $labels.instance }} "
                "are not of the type their name says (written by hand or by other code), for 15 minutes: the "
                "lease scripts cannot use them. The exporter's log names each.",
                actor=False,
            ),
        ),
        _alert(
            "DramatiqLeaseWorkerMetricsMissing",
            f"up{_sel(w)} == 0\nor\n(up{_sel(w)} == 1 unless on ({_on(cfg, 'job', 'instance')}) "
            f"dramatiq_lease_redis_errors_total{_sel(w)})",
            "5m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseWorkerMetricsMissing",
                "A worker's lease metrics are not being scraped.",
                "Target {{ $labels.instance }} of job {{ $labels.job }} is down or serves no lease metrics "
                "(its endpoint failed to start, or something else holds its port): lost leases, give-ups "
                "and renewal errors of its workers cannot alert.",
                actor=False,
            ),
        ),
        _alert(
            "DramatiqLeaseKeysFull",
            # Full keys alone are a held mutex; with messages of the actor waiting, throughout, they are a limit
            # that caps the actor's throughput.
            f"max by ({by}) (dramatiq_lease_keys_full{_sel(e)}) > 0\n"
            f"and on ({_on(cfg, 'actor_name')})\n"
            f"max by ({_on(cfg, 'actor_name')}) (dramatiq_lease_waiting{_sel(e)}) > 0",
            cfg.keys_full_for,
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseKeysFull",
                "Lease keys have been at their holder limit while messages wait for them.",
                "{{ $value }} key(s) " + where + f" have been at their limit of holders for {cfg.keys_full_for} "
                "(lock_limit; a key of one holder while held) while messages of the actor wait in their lines: "
                "the limit, or the holders' time, caps its throughput.",
            ),
        ),
        _alert(
            "DramatiqLeaseExpired",
            f"max by ({by}) (increase(dramatiq_lease_expired_total{_sel(e)}[15m])) > 0",
            "1m",
            "warning",
            _annotations(
                cfg,
                "DramatiqLeaseExpired",
                "Leases ended by TTL expiry instead of being released.",
                "About {{ $value | humanize }} lease(s) " + where + " expired in Redis in the last 15 minutes "
                "instead of being released: their holders crashed, were killed or stopped renewing.",
            ),
        ),
    ]
    for name, metric, events, objective, summary in (
        (
            "DramatiqLeaseSafetyBudgetBurn",
            "unsafe_ends_per_grant",
            "unsafe_ends",
            cfg.safety_objective,
            "Leases are lost or expire under running jobs faster than the safety objective allows.",
        ),
        (
            "DramatiqLeaseLivenessBudgetBurn",
            "gave_up_per_message",
            "gave_up",
            cfg.liveness_objective,
            "Messages give up waiting for their lease faster than the liveness objective allows.",
        ),
    ):
        budget = 1 - objective
        unit = "grants" if metric.startswith("unsafe") else "messages"
        for severity, long, short, factor, for_ in BURN_RATES:
            threshold = f"({factor:g} * {budget:.6g})"
            # A low-traffic actor burns its budget with one event: those page only from slo_min_events on
            # (a single loss or give-up has its own warning).
            expr = (
                f"actor:dramatiq_lease_{metric}:ratio_rate{long} > {threshold}\n"
                f"and\nactor:dramatiq_lease_{metric}:ratio_rate{short} > {threshold}\n"
                f"and on ({_on(cfg, 'actor_name', 'queue_name')})\n"
                f"actor:dramatiq_lease_{events}:rate{long} * {WINDOW_SECONDS[long]} >= {cfg.slo_min_events}"
            )
            rules.append(
                _alert(
                    name,
                    expr,
                    for_,
                    severity,
                    _annotations(
                        cfg,
                        name,
                        summary,
                        "Actor {{ $labels.actor_name }} on queue {{ $labels.queue_name }} is burning its error "
                        f"budget ({budget:.3%} of {unit}) {factor:g}x too fast over {long} and {short}: "
                        "{{ $value | humanizePercentage }} now.",
                    ),
                    extra={"long": long, "short": short},
                )
            )
    return rules


def rule_groups(cfg: MixinConfig) -> dict[str, Any]:
    """The whole rule file: a recording group and an alerting group."""
    return {
        "groups": [
            {"name": "dramatiq-leases.rules", "rules": recording_rules(cfg)},
            {"name": "dramatiq-leases", "rules": alert_rules(cfg)},
        ]
    }
