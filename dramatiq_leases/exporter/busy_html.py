"""The Busy page in a browser: ``GET /busy``, one HTML page that shows ``/leases`` and refreshes itself.

A constant (it ships inside the wheel as this module): inline CSS and a little
vanilla JavaScript, no build step, no external asset. The page carries no data:
its script fetches ``/leases`` (a sibling path, so a reverse proxy's prefix is
kept) every few seconds (``?refresh=SECONDS``, 1 to 300, default 3), shows when
the last refresh succeeded and a banner when one fails, and keeps the last rows
meanwhile. It is read-only: the ``show`` command of each row is there to copy.

Keys are user data: the script builds every cell with ``textContent`` and
never parses data as HTML, and the answer's Content-Security-Policy allows only
this page's own script and style (by hash) and requests to its own origin, so
even a mistake there could not run a key's markup.
"""

from __future__ import annotations

import base64
import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse

#: The path of the Busy page (HTML), beside ``/leases`` (its JSON).
BUSY_PAGE_PATH = "/busy"

_STYLE = """
:root { color-scheme: light; --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --head: #f6f8fa;
  --leak: #cf222e; --leak-bg: #ffebe9; --warn: #9a6700; --warn-bg: #fff8c5; --ok: #1a7f37; --ok-bg: #dafbe1; }
* { box-sizing: border-box; }
body { margin: 0; padding: 16px 20px; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
  color: var(--fg); background: #fff; }
header { display: flex; flex-wrap: wrap; align-items: baseline; gap: 4px 16px; margin-bottom: 8px; }
h1 { font-size: 20px; margin: 0; }
h1 small { font-weight: normal; color: var(--muted); font-size: 14px; }
h2 { font-size: 16px; margin: 18px 0 6px; }
h2 small { font-weight: normal; color: var(--muted); font-size: 13px; }
#status { color: var(--muted); margin: 0; }
.banner { border: 1px solid; border-radius: 6px; padding: 8px 12px; margin: 8px 0; }
.banner.error { color: var(--leak); background: var(--leak-bg); }
.banner.warn { color: var(--warn); background: var(--warn-bg); }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; vertical-align: top; padding: 5px 8px; border-bottom: 1px solid var(--line); }
th { background: var(--head); font-weight: 600; white-space: nowrap; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
tr.leaked td { background: var(--leak-bg); }
tr.overdue td { background: var(--warn-bg); }
code { font: 12px/1.3 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; overflow-wrap: anywhere; }
/* Short keys and commands on one line; only a long one wraps. */
.key code { display: block; min-width: 18ch; font-size: 13px; font-weight: 600; }
code.show-command { display: block; flex: 1; min-width: 36ch; }
.muted, .holder { overflow-wrap: anywhere; }
.muted { color: var(--muted); font-size: 12px; }
.badge { display: inline-block; border-radius: 10px; padding: 0 8px; font-size: 12px; font-weight: 600;
  white-space: nowrap; }
.badge.leaked { color: #fff; background: var(--leak); }
.badge.overdue { color: var(--warn); background: #fff; border: 1px solid var(--warn); }
.badge.alive { color: var(--ok); background: var(--ok-bg); }
.badge.free { color: var(--muted); background: var(--head); }
.waiting-for { white-space: nowrap; }
.waiting-for.rate { color: var(--warn); }
.command { display: flex; gap: 6px; align-items: flex-start; }
button { font: inherit; font-size: 12px; padding: 1px 8px; border: 1px solid var(--line); border-radius: 5px;
  background: var(--head); cursor: pointer; white-space: nowrap; }
button:hover { background: #eaeef2; }
.empty { color: var(--muted); margin: 6px 0; }
footer { margin-top: 18px; color: var(--muted); font-size: 12px; }
a { color: #0969da; }
"""

_SCRIPT = """
"use strict";
(function () {
  var params = new URLSearchParams(location.search);
  var every = Math.min(300, Math.max(1, Number(params.get("refresh")) || 3));
  // Siblings of this page's path: /busy -> /leases, /prefix/busy -> /prefix/leases.
  var base = location.pathname.replace(/busy\\/*$/, "");
  var source = base + "leases";
  var LEAKED = ["holder_dead", "past_max_hold", "no_ttl"];
  var lastOk = null;
  var pending = null;

  function el(tag, text, className) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }
  function cell(row, content, className) {
    var td = el("td", null, className);
    (Array.isArray(content) ? content : [content]).forEach(function (part) {
      if (part === null || part === undefined) return;
      td.appendChild(typeof part === "object" ? part : document.createTextNode(String(part)));
    });
    row.appendChild(td);
    return td;
  }
  function seconds(value) {
    if (value === null || value === undefined) return "\\u2014";
    var s = Number(value);
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 60) return Math.floor(s) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }
  function clock(date) {
    return date.toTimeString().slice(0, 8);  // 14:02:11, local time, in every locale
  }
  function waitingFor(h) {
    // What the line waits for: its key's rate (lock_rate) until its next start, or a holder.
    if (h.waiting_for !== "rate") return el("span", "waiting for a holder", "waiting-for");
    var ms = Number(h.next_start_ms) || 0;
    var next = ms < 10000 ? Math.ceil(ms) + " ms" : seconds(ms / 1000);
    return el("span", "waiting for rate (next start in " + next + ")", "waiting-for rate");
  }
  function kind(state, leaked) {
    if (leaked) return "leaked";
    if (state === "heartbeat_overdue") return "overdue";
    return state === "free" ? "free" : "alive";
  }
  function badge(state, leaked) {
    var k = kind(state, leaked);
    return el("span", k === "leaked" ? "leaked: " + state : state, "badge " + k);
  }
  function copy(text, button) {
    function done(ok) {
      button.textContent = ok ? "Copied" : "Select and copy";
      setTimeout(function () { button.textContent = "Copy"; }, 1500);
    }
    function fallback() {
      var area = el("textarea");
      area.value = text;
      area.setAttribute("readonly", "");
      area.style.position = "fixed";
      area.style.opacity = "0";
      document.body.appendChild(area);
      area.select();
      var ok = false;
      try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
      area.remove();
      done(ok);
    }
    // The Clipboard API needs a secure context (https or localhost); else the older way.
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { done(true); }, fallback);
    } else {
      fallback();
    }
  }
  function command(text) {
    if (!text) return el("span", "\\u2014", "muted");
    var box = el("div", null, "command");
    box.appendChild(el("code", text, "show-command"));
    var button = el("button", "Copy", "copy");
    button.type = "button";
    button.title = "Copy this command";
    button.addEventListener("click", function () { copy(text, button); });
    box.appendChild(button);
    return box;
  }
  function keyCell(row, key, historyPath, extra) {
    var parts = [el("code", key)];
    if (extra) parts.push(el("div", extra, "muted"));
    if (historyPath) {
      var link = el("a", "history", "history");
      // history_path is "/leases/history?key=": kept under this page's own prefix.
      link.href = base + historyPath.replace(/^\\//, "") + encodeURIComponent(key);
      var line = el("div", null, "muted");
      line.appendChild(link);
      parts.push(line);
    }
    cell(row, parts, "key");
  }
  function fill(id, rows, build) {
    var body = document.querySelector("#" + id + " tbody");
    var fresh = document.createElement("tbody");
    rows.forEach(function (data) { fresh.appendChild(build(data)); });
    body.replaceWith(fresh);
    document.getElementById(id + "-empty").hidden = rows.length > 0;
  }
  function count(id, shown, total) {
    document.getElementById(id).textContent = shown < total ? "(" + shown + " of " + total + ")" : "(" + total + ")";
  }
  function render(doc) {
    var historyPath = doc.history_path || null;
    fill("leases", doc.leases || [], function (r) {
      var tr = el("tr", null, kind(r.state, r.leaked));
      tr.dataset.key = r.key;
      cell(tr, badge(r.state, r.leaked));
      keyCell(tr, r.key, historyPath, r.limit > 1 ? "slot " + r.slot : null);
      var holder = [el("strong", r.actor || "?"), r.queue ? " on " + r.queue : null,
        el("div", (r.host || "?") + (r.pid !== null && r.pid !== undefined ? ":" + r.pid : ""), "holder"),
        el("div", r.message_id ? "message " + r.message_id : null, "muted")];
      cell(tr, holder);
      cell(tr, String(r.fence), "num");
      cell(tr, seconds(r.age_seconds), "num");
      cell(tr, seconds(r.heartbeat_age_seconds), "num");
      cell(tr, r.ttl_left_seconds === null ? "no TTL" : seconds(r.ttl_left_seconds), "num");
      cell(tr, r.holders + " / " + r.limit, "num holders");
      cell(tr, String(r.line_length), "num line");
      cell(tr, command(r.inspect_command));
      return tr;
    });
    fill("hot-keys", doc.hot_keys || [], function (h) {
      var leaked = LEAKED.indexOf(h.state) >= 0;
      var tr = el("tr", null, kind(h.state, leaked));
      tr.dataset.key = h.key;
      keyCell(tr, h.key, historyPath, null);
      cell(tr, String(h.line_length), "num line");
      cell(tr, seconds(h.oldest_wait_seconds), "num");
      cell(tr, h.waiting_in_place + " / " + h.parked + " / " + h.promoted, "num");
      cell(tr, h.actor || "\\u2014");
      cell(tr, badge(h.state, leaked));
      cell(tr, waitingFor(h));
      cell(tr, h.holders + " / " + h.limit, "num holders");
      cell(tr, command(h.inspect_command));
      return tr;
    });
    count("leases-count", (doc.leases || []).length, doc.leases_total || 0);
    count("hot-keys-count", (doc.hot_keys || []).length, doc.hot_keys_total || 0);
    var warnings = [];
    (doc.unreachable_nodes || []).forEach(function (n) {
      warnings.push("Redis Cluster master " + n.node + " did not answer the last scan (" + n.error +
        "): the leases it holds are missing here.");
    });
    var unreadable = doc.unreadable_keys || {};
    var odd = Object.keys(unreadable).reduce(function (sum, k) { return sum + Number(unreadable[k] || 0); }, 0);
    if (odd > 0) {
      warnings.push(odd + " key(s) of an unexpected type were left out (their names are in the exporter's log).");
    }
    var box = document.getElementById("warnings");
    box.replaceChildren.apply(box, warnings.map(function (w) { return el("div", w); }));
    box.hidden = warnings.length === 0;
    return doc.scanned_at;
  }
  function status(scannedAt) {
    var text = "Updated " + clock(lastOk);
    if (scannedAt === null || scannedAt === undefined) {
      text += " \\u00b7 waiting for the exporter's first scan";
    } else {
      text += " \\u00b7 scanned " + seconds(Math.max(0, Date.now() / 1000 - scannedAt)) + " ago";
    }
    document.getElementById("status").textContent = text + " \\u00b7 refreshes every " + every + " s";
  }
  function selecting() {
    // Replacing the rows would drop a selection the reader is making (to copy a key, say): wait for it.
    var selection = window.getSelection();
    return selection && !selection.isCollapsed && document.querySelector("main").contains(selection.anchorNode);
  }
  function show(doc) {
    if (selecting()) {
      pending = doc;
      document.getElementById("status").textContent = "Read " + clock(lastOk) +
        " \u00b7 the rows wait while you select text";
      return;
    }
    pending = null;
    status(render(doc));
  }
  function fail(message) {
    var banner = document.getElementById("error");
    banner.textContent = "Refresh failed at " + clock(new Date()) + ": " + message +
      (lastOk ? ". Showing what was read at " + clock(lastOk) + "." : ".");
    banner.hidden = false;
  }
  function refresh() {
    var controller = new AbortController();
    var timer = setTimeout(function () { controller.abort(); }, 10000);
    fetch(source, { cache: "no-store", credentials: "same-origin", signal: controller.signal,
      headers: { Accept: "application/json" } })
      .then(function (response) {
        return response.json().catch(function () { return null; }).then(function (doc) {
          if (!response.ok || !doc || typeof doc !== "object") {
            var why = doc && (doc.detail || doc.error);
            throw new Error("HTTP " + response.status + (why ? " (" + why + ")" : ""));
          }
          lastOk = new Date();
          document.getElementById("error").hidden = true;
          show(doc);
        });
      })
      .catch(function (error) {
        var aborted = error && error.name === "AbortError";
        fail(aborted ? "no answer within 10 s" : (error && error.message) || String(error));
      })
      .finally(function () {
        clearTimeout(timer);
        setTimeout(refresh, every * 1000);
      });
  }
  document.querySelectorAll("a.json").forEach(function (a) { a.href = source; });
  document.addEventListener("selectionchange", function () {
    if (pending && !selecting()) show(pending);
  });
  refresh();
})();
"""

_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>Busy \u00b7 dramatiq-leases</title>
<style>{style}</style>
</head>
<body>
<header>
<h1>Busy <small>dramatiq-leases: who holds what, right now</small></h1>
<p id="status" role="status">Loading\u2026</p>
</header>
<div id="error" class="banner error" role="alert" hidden></div>
<div id="warnings" class="banner warn" hidden></div>
<noscript><div class="banner warn">This page needs JavaScript; its data is <a href="leases">/leases</a>
(JSON).</div></noscript>
<main>
<h2>Leases held now <small id="leases-count"></small></h2>
<table id="leases">
<thead><tr><th>State</th><th>Key</th><th>Holder</th><th>Fence</th><th>Age</th><th>Heartbeat</th>
<th>TTL left</th><th>Holders</th><th>Line</th><th>Inspect</th></tr></thead>
<tbody></tbody>
</table>
<p id="leases-empty" class="empty" hidden>No lease is held.</p>
<h2>Hot keys: the longest lines <small id="hot-keys-count"></small></h2>
<table id="hot-keys">
<thead><tr><th>Key</th><th>Line</th><th>Oldest wait</th><th>In place / parked / promoted</th><th>Actor</th>
<th>State</th><th>Waiting for</th><th>Holders</th><th>Inspect</th></tr></thead>
<tbody></tbody>
</table>
<p id="hot-keys-empty" class="empty" hidden>No key has a line.</p>
</main>
<footer>Read-only: most worrying first (leaked, then overdue heartbeats, then the oldest grants), as of the
exporter's last scan. The same data as JSON: <a class="json" href="leases">/leases</a>. Release a leaked lease with
<code>dramatiq-leases release --if-dead KEY</code>.</footer>
<script>{script}</script>
</body>
</html>
"""

#: The page, as served.
BUSY_PAGE = _TEMPLATE.format(style=_STYLE, script=_SCRIPT).encode("utf-8")


def _source_hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode("utf-8")).digest()).decode() + "'"


#: Only this page's own script and style run, and it reaches only its own origin.
CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_source_hash(_SCRIPT)}; style-src {_source_hash(_STYLE)}; "
    "connect-src 'self'; img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def respond(start_response: StartResponse, head: bool = False) -> list[bytes]:
    """Answer ``200 OK`` with the page (no body for a ``HEAD``), for a caller that may read the Busy view."""
    start_response(
        "200 OK",
        [
            ("Content-Type", "text/html; charset=utf-8"),
            ("Content-Length", str(len(BUSY_PAGE))),
            ("Cache-Control", "no-store"),
            ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
            ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"),
        ],
    )
    return [] if head else [BUSY_PAGE]
