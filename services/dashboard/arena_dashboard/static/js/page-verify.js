// Verify stats: verdicts, FAIL_TO_PASS / PASS_TO_PASS counts, every hack-suspect flag with its
// rollouts, parser failures, verifier latency.
import { api, card, chart, dataset, el, empty, href, ms, num, rolloutLink, table } from "./ui.js";
import { windowParams, windowSelector } from "./page-overview.js";

export const kind = "verify";

export async function render(ctx) {
  const { params } = ctx.route;
  const { since } = windowParams(params);
  const task_id = params.get("task_id") || "";
  const v = await api("stats/verification", { since, task_id });
  const verdicts = v.verdicts || {};
  const t = v.tests || {};
  const flags = v.flags || [];
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Verification"), task_id ? el("span", { class: "badge accent" }, `task ${task_id}`) : null,
      el("span", { class: "spacer" }), windowSelector("verify", params, task_id ? { task_id } : {})),
    el("div", { class: "grid tiles" },
      ...["passed", "failed", "infrastructure", "unverified"].map(k => el("div", { class: "card tile" },
        el("div", { class: "label" }, k), el("div", { class: "value" }, num(verdicts[k] ?? 0, 0)))),
      el("div", { class: "card tile" }, el("div", { class: "label" }, "parser failures"), el("div", { class: "value" }, num(v.parser_failures ?? 0, 0)))),
    el("div", { class: "grid cols2" },
      card("Verdicts",
        chart("doughnut", { labels: Object.keys(verdicts), datasets: [{ data: Object.values(verdicts),
          backgroundColor: ["#2f5bea", "#c23b3b", "#8a94a8", "#d9dce3"] }] },
          { plugins: { legend: { display: true, position: "right" } } })),
      card("Tests: FAIL_TO_PASS and PASS_TO_PASS",
        chart("bar", { labels: ["FAIL_TO_PASS", "PASS_TO_PASS"], datasets: [
          dataset("passed", [t.f2p_passed ?? 0, t.p2p_passed ?? 0], 0),
          dataset("failed", [t.f2p_failed ?? 0, t.p2p_failed ?? 0], 4)] }, { scales: { x: { stacked: true }, y: { stacked: true } } }))),
    el("div", { style: "height:14px" }),
    card(`Flags (${flags.length})`, el("p", { class: "muted" }, "Hack suspects raised by the sandbox and verification planes (tests edited, conftest added, runner or git history tampered with)."),
      flags.length ? el("table", { id: "flags" }, el("thead", {}, el("tr", {}, el("th", {}, "flag"), el("th", { class: "num" }, "rollouts"), el("th", {}, "rollouts behind it"))),
        el("tbody", {}, flags.map(f => el("tr", { class: "flag-row", "data-flag": f.flag },
          el("td", {}, el("span", { class: "badge bad" }, f.flag)), el("td", { class: "num" }, num(f.count, 0)),
          el("td", {}, (f.rollout_ids || []).slice(0, 12).map(id => [rolloutLink(id), " "]),
            f.count > (f.rollout_ids || []).length ? el("span", { class: "muted" }, `and ${f.count - f.rollout_ids.length} more`) : null)))))
        : empty("No flags in this window.")),
    el("div", { style: "height:14px" }),
    el("div", { class: "grid cols2" },
      card("Parsers", (v.parsers || []).length ? table(["parser", "verifications"], v.parsers.map(p => [p.parser || "(none)", num(p.count, 0)]), { numeric: [1] })
        : empty("No parser used.")),
      card("Verifier latency", (v.latency_ms || []).length ? table(["verifier", "runs", "p50", "p95"],
        v.latency_ms.map(l => [l.verifier, num(l.count, 0), ms(l.p50), ms(l.p95)]), { numeric: [1, 2, 3] }) : empty("No verification yet."))));
}
