// Live updates: the server pushes "refresh" over Server-Sent Events (on a NOTIFY
// of a job table, and every poll interval where NOTIFY is off); the page then
// fetches itself again and swaps its live region in place, htmx-style.
(function () {
  "use strict";
  var main = document.querySelector("main[data-live]");
  var source = main && main.getAttribute("data-live");
  var region = document.getElementById("live-region");
  var status = document.getElementById("live-status");
  if (!source || !region || !window.EventSource) { return; }
  var pending = false;
  function refresh() {
    if (pending) { return; }
    pending = true;
    fetch(window.location.href, { headers: { "X-Live-Refresh": "1" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("live-region");
        if (fresh) { region.innerHTML = fresh.innerHTML; }
        if (status) { status.textContent = "updated " + new Date().toLocaleTimeString(); }
        document.body.setAttribute("data-refreshed", String(Date.now()));
      })
      .finally(function () { pending = false; });
  }
  var events = new EventSource(source);
  events.addEventListener("refresh", refresh);
  events.onopen = function () {
    if (status) { status.textContent = "live"; }
    document.body.setAttribute("data-live-open", "1");
  };
  events.onerror = function () { if (status) { status.textContent = "reconnecting…"; } };
})();
