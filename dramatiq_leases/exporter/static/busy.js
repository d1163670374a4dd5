"use strict";
(function () {
  var params = new URLSearchParams(location.search);
  var every = Math.min(300, Math.max(1, Number(params.get("refresh")) || 3));
  // Siblings of this page's path: /busy -> /leases, /prefix/busy -> /prefix/leases.
  var base = location.pathname.replace(/busy\/*$/, "");
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
    if (value === null || value === undefined) return "\u2014";
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
    if (!text) return el("span", "\u2014", "muted");
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
      link.href = base + historyPath.replace(/^\//, "") + encodeURIComponent(key);
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
      cell(tr, h.actor || "\u2014");
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
      text += " \u00b7 waiting for the exporter's first scan";
    } else {
      text += " \u00b7 scanned " + seconds(Math.max(0, Date.now() / 1000 - scannedAt)) + " ago";
    }
    document.getElementById("status").textContent = text + " \u00b7 refreshes every " + every + " s";
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
        " · the rows wait while you select text";
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
