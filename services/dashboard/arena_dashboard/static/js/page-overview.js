// Overview: throughput, live counters, outcome rates, reward and its change, latency per plane.
import { api, card, chart, dataset, el, href, ms, num, pct, signed, tile, table } from "./ui.js";
import { live as liveState } from "./live.js";

export const kind = "overview";
const WINDOWS = { "15m": 900, "1h": 3600, "24h": 86400, all: 0 };

export function windowParams(params) {
  const w = WINDOWS[params.get("window")] !== undefined ? params.get("window") : "1h";
  return { window: w, since: WINDOWS[w] ? (Date.now() / 1000 - WINDOWS[w]).toFixed(0) : "" };
}

export function windowSelector(page, params, extra = {}) {
  const { window: w } = windowParams(params);
  return el("span", { class: "seg", role: "group", "aria-label": "time window" },
    Object.keys(WINDOWS).map(k => el("a", { href: href(page, { ...extra, window: k }), class: k === w ? "on" : "" },
      k === "all" ? "all" : `last ${k}`)));
}

function liveTiles() {
  const c = liveState.counters;
  const v = x => (x === null || x === undefined ? "–" : String(x));
  const sandboxes = c.running === null ? null : c.running + c.verifying;
  return [
    tile("Running", el("span", { id: "ov-running" }, v(c.running)), "agents in sandboxes", "live"),
    tile("Queued", el("span", { id: "ov-queued" }, v(c.queued)), "pending + provisioning", "live"),
    tile("Verifying", el("span", { id: "ov-verifying" }, v(c.verifying)), "verifier sandboxes", "live"),
    tile("Sandboxes live", el("span", { id: "ov-sandboxes" }, v(sandboxes)), "agent + verification", "live"),
  ];
}

export function live() {
  return {
    counters: c => {
      const set = (id, x) => { const n = document.getElementById(id); if (n) n.textContent = x ?? "–"; };
      set("ov-running", c.running); set("ov-queued", c.queued); set("ov-verifying", c.verifying);
      set("ov-sandboxes", c.running === null ? null : c.running + c.verifying);
    },
  };
}

export async function render(ctx) {
  const { params } = ctx.route;
  const { since } = windowParams(params);
  const o = await api("stats/overview", { since });
  const lat = o.latency_ms || {};
  const planes = ["rollout", "queue", "sandbox", "verification", "llm"];
  const change = o.reward_change;
  const changeCls = change > 0 ? "up" : change < 0 ? "down" : "";
  const by = o.by_state || {};
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Overview"), el("span", { class: "spacer" }),
      windowSelector("overview", params)),
    el("div", { class: "grid tiles" },
      tile("Rollouts / s", num(o.rollouts_per_s, 3), `${num(o.rollouts, 0)} rollouts ended`),
      ...liveTiles(),
      tile("Mean reward", num(o.mean_reward, 3),
        el("span", { class: changeCls }, `${signed(change)} since the window began`)),
    ),
    el("div", { class: "grid tiles" },
      tile("Success rate", pct(o.success_rate), "completed and passed"),
      tile("Error rate", pct(o.error_rate), `${num(by.failed, 0)} failed`),
      tile("Timeout rate", pct(o.timeout_rate), `${num(by.timed_out, 0)} timed out`),
      tile("Budget exhausted", pct(o.budget_exhausted_rate), `${num(by.budget_exhausted, 0)} rollouts`),
      tile("Infrastructure errors", pct(o.infrastructure_error_rate), "no reward: kept out of training"),
    ),
    el("div", { class: "grid cols2" },
      card("Latency by plane (p50 / p95)",
        table(["plane", "p50", "p95", "samples"],
          planes.map(p => [p, ms(lat[p]?.p50), ms(lat[p]?.p95), num(lat[p]?.count, 0)]), { numeric: [1, 2, 3] }),
        chart("bar", { labels: planes, datasets: [
          dataset("p50", planes.map(p => (lat[p]?.p50 ?? 0) / 1000), 0),
          dataset("p95", planes.map(p => (lat[p]?.p95 ?? 0) / 1000), 1)] },
          { scales: { y: { title: { display: true, text: "seconds" } } } })),
      card("Outcomes",
        chart("bar", { labels: Object.keys(by).map(s => s.replace("_", " ")),
                       datasets: [dataset("rollouts", Object.values(by), 0)] },
              { plugins: { legend: { display: false } }, indexAxis: "y" }),
        el("p", { class: "muted" }, "Each state links to its rollouts: ",
          ...Object.keys(by).map((s, i) => [i ? " · " : "", el("a", { href: href("rollouts", { state: s }) }, s.replace("_", " "))]))),
    ));
}
