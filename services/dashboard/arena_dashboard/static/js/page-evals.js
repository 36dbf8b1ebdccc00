// Evaluations: the `arena eval` jobs whose reports the CLI stored on the trajectory service
// (docs/evaluation.md), and one job's report as its HTML report shows it: models with pass@k,
// pass^k and mean reward (95% intervals), the pass@k curve over k, paired comparisons, ratings,
// cost, and a heat map of models × tasks. #/evals lists; #/evals/<job>?version=N opens one.
import { api, card, el, empty, href, num, when } from "./ui.js";

export const kind = "evals";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
function svg(tag, attrs, text) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  if (text !== undefined) n.textContent = text;
  return n;
}

// three decimals always, as report.html and the CLI's table print them
const fix = v => (v === null || v === undefined) ? "–" : Number(v).toFixed(3);
const est = e => (e && e.value !== null && e.value !== undefined) ? `${fix(e.value)} [${fix(e.ci_low)}, ${fix(e.ci_high)}]` : "–";
const usd = x => (x === null || x === undefined) ? "–" : `$${Number(x).toFixed(4)}`;

// pass@k over k = 1..K per model: the estimate's line and its interval as a band.
export function passAtKCurve(report) {
  const K = report.spec.k, width = 560, height = 300, left = 48, right = 140, top = 16, bottom = 36;
  const w = width - left - right, h = height - top - bottom;
  const x = k => left + (K > 1 ? w * (k - 1) / (K - 1) : w / 2), y = v => top + h * (1 - v);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "passk", role: "img", "aria-label": "pass@k over k" });
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    root.append(svg("line", { x1: left, x2: left + w, y1: y(v), y2: y(v), stroke: "#eef0f4" }));
    root.append(svg("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end", "font-size": 11, fill: "#6b7385" }, v.toFixed(2)));
  }
  for (let k = 1; k <= K; k++) root.append(svg("text", { x: x(k), y: top + h + 16, "text-anchor": "middle", "font-size": 11, fill: "#6b7385" }, String(k)));
  root.append(svg("text", { x: left + w / 2, y: height - 4, "text-anchor": "middle", "font-size": 11, fill: "#6b7385" }, "k"));
  report.models.forEach((m, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = [];
    for (let k = 1; k <= K; k++) { const e = m.pass_at[String(k)]; if (e && e.value !== null) pts.push([k, e]); }
    if (!pts.length) return;
    const band = pts.map(([k, e]) => `${x(k)},${y(e.ci_high)}`).concat(pts.slice().reverse().map(([k, e]) => `${x(k)},${y(e.ci_low)}`));
    root.append(svg("polygon", { points: band.join(" "), fill: color, "fill-opacity": 0.15, stroke: "none" }));
    root.append(svg("polyline", { points: pts.map(([k, e]) => `${x(k)},${y(e.value)}`).join(" "), fill: "none", stroke: color, "stroke-width": 2, "data-model": m.model }));
    for (const [k, e] of pts) root.append(svg("circle", { cx: x(k), cy: y(e.value), r: 3, fill: color }));
    root.append(svg("text", { x: left + w + 10, y: top + 14 + 16 * i, "font-size": 12, fill: color }, m.model.slice(0, 20)));
  });
  return root;
}

// models × tasks, each cell the task's solved share (its successes over attempts with a verdict).
export function heatMap(report) {
  const models = report.spec.models, tasks = report.spec.tasks.map(t => t.task_id);
  const cell = {};
  for (const c of report.tasks) cell[`${c.model}\u0000${c.task_id}`] = c;
  const shade = v => `hsl(${Math.round(120 * v)}, 60%, ${Math.round(88 - 38 * v)}%)`;
  return el("div", { class: "heat-wrap" }, el("table", { class: "heat", id: "eval-heat" },
    el("thead", {}, el("tr", {}, el("th", {}, "task"), models.map(m => el("th", {}, m)))),
    el("tbody", {}, tasks.map(t => el("tr", { "data-task": t }, el("td", { class: "mono" }, t), models.map(m => {
      const c = cell[`${m}\u0000${t}`];
      const share = c && c.n ? c.successes / c.n : null;
      return el("td", { class: "num", style: share === null ? "" : `background:${shade(share)}`,
                        title: c ? `${m} on ${t}: ${c.successes}/${c.n} solved, ${c.infrastructure} infrastructure` : "",
                        "data-model": m }, c && c.n ? `${c.successes}/${c.n}` : "–");
    }))))));
}

function listing(jobs) {
  if (!jobs.length) return empty("No evaluation reports yet: `arena eval run` (or `arena eval report JOB`) stores them here.");
  return el("table", { id: "evals" },
    el("thead", {}, el("tr", {}, ["job", "created", "dataset", "agent", "tasks", "k", "versions", "models: pass@1 · pass@k · mean reward"]
      .map((h, i) => el("th", { class: [4, 5].includes(i) ? "num" : "" }, h)))),
    el("tbody", {}, jobs.map(j => el("tr", { "data-job": j.job_id },
      el("td", {}, el("a", { href: href("evals", {}, j.job_id), class: "mono" }, j.job_id)),
      el("td", { class: "muted" }, when(j.created_at)), el("td", { class: "mono" }, j.dataset.split("/").slice(-2).join("/")),
      el("td", {}, j.agent), el("td", { class: "num" }, num(j.tasks, 0)), el("td", { class: "num" }, num(j.k, 0)),
      el("td", {}, j.versions.map(v => el("a", { href: href("evals", { version: v }, j.job_id), class: "badge" }, `v${v}`))),
      el("td", {}, j.models.map(m => el("div", {}, el("b", {}, m.model), ` ${fix(m.pass_at_1)} · ${fix(m.pass_at_k)} · ${fix(m.mean_reward)}`)))))));
}

function job(doc) {
  const r = doc.report, K = r.spec.k;
  const models = el("table", { id: "eval-models" },
    el("thead", {}, el("tr", {}, ["model", "attempts", "completed", "failed", "infra", "pass@1", `pass@${K}`, `pass^${K}`, "mean reward"]
      .map((h, i) => el("th", { class: i ? "num" : "" }, h)))),
    el("tbody", {}, r.models.map(m => el("tr", { "data-model": m.model }, el("td", {}, m.model),
      [m.attempts, m.completed, m.failed, m.infrastructure].map(v => el("td", { class: "num" }, num(v, 0))),
      [m.pass_at["1"], m.pass_at[String(K)], m.pass_hat[String(K)], m.mean_reward].map(e => el("td", { class: "num" }, est(e)))))));
  const comparisons = r.comparisons.length ? el("table", { id: "eval-comparisons" },
    el("thead", {}, el("tr", {}, ["A", "B", "metric", "A − B", "95% interval", "p", "tasks A>B / A<B / ="].map((h, i) => el("th", { class: i > 2 ? "num" : "" }, h)))),
    el("tbody", {}, r.comparisons.map(c => el("tr", {}, el("td", {}, c.a), el("td", {}, c.b), el("td", {}, c.metric),
      el("td", { class: "num" }, fix(c.difference)), el("td", { class: "num" }, `[${fix(c.ci_low)}, ${fix(c.ci_high)}]`),
      el("td", { class: "num" }, c.p_value === null ? "–" : c.p_value < 1e-4 ? "<1e-4" : Number(c.p_value).toPrecision(3)),
      el("td", { class: "num" }, `${c.better} / ${c.worse} / ${c.same}`))))) : empty("One model: nothing to compare.");
  const ratings = r.ratings.length ? el("table", { id: "eval-ratings" },
    el("thead", {}, el("tr", {}, ["model", "rating", "95% interval", "games", "W / L / D"].map((h, i) => el("th", { class: i ? "num" : "" }, h)))),
    el("tbody", {}, r.ratings.map(x => el("tr", {}, el("td", {}, x.policy), el("td", { class: "num" }, num(x.rating, 1)),
      el("td", { class: "num" }, `[${num(x.ci_low, 0)}, ${num(x.ci_high, 0)}]`), el("td", { class: "num" }, num(x.games, 0)),
      el("td", { class: "num" }, `${x.wins} / ${x.losses} / ${x.draws}`))))) : empty("One model: no ratings.");
  const costRow = (name, c) => el("tr", {}, el("td", {}, name), [c.tries, c.prompt_tokens, c.cached_tokens ?? 0, c.completion_tokens].map(v => el("td", { class: "num" }, num(v, 0))),
    el("td", { class: "num" }, num(c.agent_s, 1)), el("td", { class: "num" }, usd(c.agent_usd)),
    el("td", { class: "num" }, num(c.judge_prompt_tokens + c.judge_completion_tokens, 0)), el("td", { class: "num" }, usd(c.judge_usd)),
    el("td", { class: "num" }, num(c.verify_s, 1)));
  const cost = el("table", { id: "eval-cost" },
    el("thead", {}, el("tr", {}, ["model", "tries", "prompt tok", "of which cached", "compl tok", "agent s", "agent $", "judge tok", "judge $", "verify s"]
      .map((h, i) => el("th", { class: i ? "num" : "" }, h)))),
    el("tbody", {}, r.models.map(m => costRow(m.model, m.cost)), costRow("(all)", r.cost)));
  const g = r.grading;
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, `Evaluation ${r.spec.job_id}`),
      el("span", { class: "muted" }, `${r.spec.tasks.length} task(s) of ${r.spec.dataset} · agent ${r.spec.agent} · k = ${K} · success = reward ≥ ${r.spec.success_threshold}`),
      el("span", {}, doc.versions.map(v => el("a", { href: href("evals", { version: v }, r.spec.job_id), class: `badge ${v === doc.version ? "accent" : ""}`, "data-version": v }, `v${v}`)))),
    g && g.version > 1 ? el("p", { class: "muted", id: "eval-grading" }, `Grading version ${g.version}: ${g.regraded} attempt(s) verified again by ${g.source} (stored as ${g.verifier})`) : null,
    el("div", { class: "grid cols2" },
      card("Models (95% intervals: bootstrap over tasks)", models),
      card(`pass@k over k (bands: 95% intervals)`, passAtKCurve(r))),
    el("div", { style: "height:14px" }),
    el("div", { class: "grid cols2" }, card("Paired comparisons (sign-flip test)", comparisons), card("Bradley–Terry ratings", ratings)),
    el("div", { style: "height:14px" }),
    card("Cost (every try; judge and verifier apart from the agent)", cost),
    el("div", { style: "height:14px" }),
    card("Tasks × models (solved / attempts with a verdict)", heatMap(r)));
}

export async function render(ctx) {
  const id = ctx.route.id;
  if (id) {
    const version = ctx.route.params.get("version");
    return job(await api(`evals/${encodeURIComponent(id)}`, { version }));
  }
  const list = await api("evals", { limit: 100 });
  return el("div", {}, el("div", { class: "bar" }, el("h1", {}, "Evaluations"),
    el("span", { class: "muted" }, "jobs of `arena eval`, newest first")), card("Jobs", listing(list.jobs || [])));
}
