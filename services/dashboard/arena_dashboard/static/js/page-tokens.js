// Token stats: prompt and completion lengths, truncation, turns and tool calls, tokens/s per
// backend replica and per policy version.
import { api, card, chart, dataset, el, empty, num, pct, table, tile } from "./ui.js";
import { windowParams, windowSelector } from "./page-overview.js";

export const kind = "tokens";

function histogram(dist, label, i) {
  const buckets = dist?.buckets || [];
  if (!buckets.length) return empty("No steps yet.");
  return chart("bar", { labels: buckets.map(b => `≤ ${num(b.le, 0)}`), datasets: [dataset(label, buckets.map(b => b.count), i)] },
    { plugins: { legend: { display: false } }, scales: { x: { title: { display: true, text: "tokens per step" } },
                                                       y: { title: { display: true, text: "steps" } } } });
}

function summary(d) {
  return d ? `mean ${num(d.mean, 1)} · p50 ${num(d.p50, 0)} · p95 ${num(d.p95, 0)} · max ${num(d.max, 0)}` : "–";
}

export async function render(ctx) {
  const { params } = ctx.route;
  const { since } = windowParams(params);
  const u = await api("stats/token-usage", { since, task_id: params.get("task_id") || "" });
  const backends = u.by_backend || [];
  const versions = u.by_policy_version || [];
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Tokens"), el("span", { class: "spacer" }), windowSelector("tokens", params)),
    el("div", { class: "grid tiles" },
      tile("LLM calls", num(u.steps, 0), "steps captured"),
      tile("Truncation rate", pct(u.truncation_rate), "finish_reason = length"),
      tile("Turns / rollout", num(u.turns?.mean, 2), summary(u.turns)),
      tile("Tool calls / rollout", num(u.tool_calls?.mean, 2), summary(u.tool_calls)),
      tile("Completion tokens", num(u.completion_tokens?.mean, 1), "mean per call")),
    el("div", { class: "grid cols2" },
      card("Prompt length", el("p", { class: "muted" }, summary(u.prompt_tokens)), histogram(u.prompt_tokens, "prompt", 1)),
      card("Completion length", el("p", { class: "muted" }, summary(u.completion_tokens)), histogram(u.completion_tokens, "completion", 0))),
    el("div", { style: "height:14px" }),
    el("div", { class: "grid cols2" },
      card("Tokens/s per backend replica", backends.length ? [
        chart("bar", { labels: backends.map(b => b.backend), datasets: [dataset("tokens/s", backends.map(b => b.tokens_per_s), 0)] },
          { plugins: { legend: { display: false } }, indexAxis: "y" }),
        table(["replica", "calls", "completion tokens", "tokens/s"], backends.map(b => [el("code", {}, b.backend), num(b.steps, 0),
          num(b.completion_tokens, 0), num(b.tokens_per_s, 1)]), { numeric: [1, 2, 3] })] : empty("No calls yet.")),
      card("Per policy version", versions.length ? [
        chart("bar", { labels: versions.map(v => v.policy_version || "(unknown)"), datasets: [dataset("tokens/s", versions.map(v => v.tokens_per_s ?? 0), 0)] },
          { plugins: { legend: { display: false } } }),
        table(["policy version", "calls", "completion tokens", "tokens/s"], versions.map(v => [v.policy_version || "(unknown)", num(v.steps, 0),
          num(v.completion_tokens, 0), num(v.tokens_per_s, 1)]), { numeric: [1, 2, 3] })] : empty("No calls yet."))));
}
