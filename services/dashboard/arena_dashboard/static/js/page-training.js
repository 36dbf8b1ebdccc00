// Training: reward curve per task set and policy version, zero-variance group rate, staleness and
// the trainer's own metrics, live as the trainer posts them (arena.trainer.metrics).
import { api, card, chart, dataset, el, empty, href, num } from "./ui.js";

export const kind = "training";
const KNOWN = ["loss", "kl", "entropy", "grad_norm", "lr", "learning_rate", "staleness_mean", "mean_reward", "clip_fraction", "tokens_per_s"];
let last = null;  // the last answer, which live trainer steps extend without a re-fetch

export function live(ctx) {
  return {
    trainer: m => {
      const run = ctx.route.params.get("run");
      if (!last || (run && m.run !== run)) return;
      if (last.trainer.some(s => s.step === m.step && (s.run ?? m.run) === m.run)) return;
      last.trainer.push(m);
      ctx.local = true;
      ctx.redraw().finally(() => { ctx.local = false; });
    },
  };
}

// A metric's axis: tiny or huge values (a policy loss of 1e-8) in short exponent form, never "-5.000000000E-9".
function tick(v) {
  const a = Math.abs(v);
  return a && (a < 1e-3 || a >= 1e6) ? Number(v).toExponential(1) : num(v, 4);
}

// No policy version known (the backends report none): the mean reward over time instead.
function rewardOverTime(points) {
  if (!(points || []).length) return empty("No rollouts with a reward yet.");
  const labels = points.map(p => new Date(p.at * 1000).toLocaleString());
  return chart("line", { labels, datasets: [dataset("mean reward", points.map(p => p.mean_reward), 0, { spanGaps: true })] },
    { scales: { x: { title: { display: true, text: "time (no policy version reported)" } },
                y: { title: { display: true, text: "mean reward" } } } });
}

export function rewardCurve(all, overTime = []) {
  const curve = all.filter(r => r.policy_version);  // no policy version: no LLM call was served, no point on a curve
  if (!curve.length) return rewardOverTime(overTime);
  const versions = [...new Map(curve.slice().sort((a, b) => (a.first_completed_at || 0) - (b.first_completed_at || 0))
    .map(r => [r.policy_version, 1])).keys()];
  const sets = [...new Set(curve.map(r => r.task_set))];
  const datasets = sets.map((s, i) => dataset(s || "(no task set)", versions.map(v => {
    const r = curve.find(x => x.policy_version === v && x.task_set === s);
    return r ? r.mean_reward : null;
  }), i, { spanGaps: true }));
  return chart("line", { labels: versions, datasets },
    { scales: { x: { title: { display: true, text: "policy version" } }, y: { title: { display: true, text: "mean reward" } } } });
}

export async function render(ctx) {
  const { params } = ctx.route;
  const run = params.get("run") || "";
  if (!(ctx.local && last)) last = await api("stats/training", { run });
  const d = last;
  const trainer = (d.trainer || []).slice().sort((a, b) => a.step - b.step);
  const names = [...new Set(trainer.flatMap(s => Object.keys(s.metrics || {})))];
  const ordered = [...KNOWN.filter(k => names.includes(k)), ...names.filter(k => !KNOWN.includes(k))].slice(0, 12);
  const zv = d.zero_variance || [];
  const form = el("form", { class: "bar filters" }, el("input", { name: "run", placeholder: "trainer run", value: run }),
    el("button", { type: "submit", class: "primary" }, "Show run"));
  form.addEventListener("submit", ev => { ev.preventDefault(); location.hash = href("training", { run: new FormData(form).get("run") }); });
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Training"), el("span", { class: "muted" }, run ? `run ${run}` : "latest run"),
      el("span", { class: "spacer" }), form),
    el("div", { class: "grid cols2" },
      card((d.reward_over_time || []).length ? "Reward over time" : "Reward per policy version and task set",
        rewardCurve(d.reward_curve || [], d.reward_over_time || [])),
      card("Zero-variance groups (no GRPO signal)", zv.length ? chart("line", { labels: zv.map(z => z.policy_version || "(unknown)"),
        datasets: [dataset("share of groups", zv.map(z => z.rate), 0)] },
        { plugins: { legend: { display: false } }, scales: { y: { max: 1, title: { display: true, text: "rate" } } } })
        : empty("No complete groups yet."))),
    el("div", { style: "height:14px" }),
    el("h2", {}, `Trainer metrics (${trainer.length} steps)`),
    trainer.length ? el("div", { class: "grid cols3", id: "trainer-charts" }, ordered.map((name, i) => card(name,
      chart("line", { labels: trainer.map(s => s.step), datasets: [dataset(name, trainer.map(s => s.metrics?.[name] ?? null), i % 3 === 2 ? 2 : i % 2, { spanGaps: true })] },
        { plugins: { legend: { display: false } }, scales: { y: { beginAtZero: false, ticks: { callback: tick } }, x: { title: { display: true, text: "step" } } } }),
      el("div", { class: "muted" }, `last ${num(trainer.map(s => s.metrics?.[name]).filter(v => v !== undefined && v !== null).pop(), 4)}`))))
      : card(null, empty("No trainer metrics yet: a trainer posts them to the trajectory API (POST /v1/trainer-metrics).")));
}
