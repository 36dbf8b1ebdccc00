// Leaderboard and duels: ratings with confidence intervals, recent duels with their rounds (both
// rollouts linked), live on arena.duel.done; the GRPO reward curve beside it.
import { api, card, el, empty, href, num, rolloutLink, when } from "./ui.js";
import { rewardCurve } from "./page-training.js";

export const kind = "leaderboard";

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  if (text !== undefined) n.textContent = text;
  return n;
}

// A forest plot: one row per policy, a dot at its rating and whiskers over its interval.
function forest(ratings) {
  const rowH = 30, left = 170, right = 70, width = 640, top = 24;
  const lo = Math.min(...ratings.map(r => r.ci_low ?? r.rating)), hi = Math.max(...ratings.map(r => r.ci_high ?? r.rating));
  const pad = (hi - lo) * 0.08 || 10;
  const x = v => left + ((v - (lo - pad)) / ((hi + pad) - (lo - pad))) * (width - left - right);
  const height = top + rowH * ratings.length + 10;
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "forest", role: "img", "aria-label": "ratings with confidence intervals" });
  for (const tick of [lo, (lo + hi) / 2, hi]) {
    root.append(svg("line", { x1: x(tick), x2: x(tick), y1: top - 6, y2: height - 6, stroke: "#eef0f4" }));
    root.append(svg("text", { x: x(tick), y: 12, "text-anchor": "middle", "font-size": 11, fill: "#6b7385" }, num(tick, 0)));
  }
  ratings.forEach((r, i) => {
    const y = top + i * rowH + rowH / 2;
    root.append(svg("text", { x: 0, y: y + 4, "font-size": 12.5, fill: "#1d2330" }, `${i + 1}. ${r.policy}`.slice(0, 24)));
    root.append(svg("line", { x1: x(r.ci_low ?? r.rating), x2: x(r.ci_high ?? r.rating), y1: y, y2: y, stroke: "#2f5bea", "stroke-width": 2 }));
    for (const end of [r.ci_low, r.ci_high]) if (end !== null && end !== undefined)
      root.append(svg("line", { x1: x(end), x2: x(end), y1: y - 6, y2: y + 6, stroke: "#2f5bea", "stroke-width": 2 }));
    root.append(svg("circle", { cx: x(r.rating), cy: y, r: 5, fill: "#2f5bea" }));
    root.append(svg("text", { x: width - right + 8, y: y + 4, "font-size": 12, fill: "#1d2330" }, num(r.rating, 0)));
  });
  return root;
}

function duelRow(d, open) {
  const [a, b] = d.policies || ["?", "?"];
  const [wa, wb] = d.wins || [0, 0];
  const winner = d.winner === "a" ? a : d.winner === "b" ? b : d.winner;
  return el("tr", { "data-duel": d.duel_id },
    el("td", {}, el("a", { href: href("leaderboard", open ? {} : { duel: d.duel_id }), class: "mono" }, d.duel_id)),
    el("td", {}, el("a", { href: href("rollouts", { task_id: d.task_id }) }, d.task_id)),
    el("td", {}, el("b", {}, a), " vs ", el("b", {}, b)),
    el("td", { class: "num" }, `${wa} – ${wb}`), el("td", { class: "num" }, num(d.draws, 0)), el("td", { class: "num" }, num(d.void, 0)),
    el("td", {}, d.complete ? el("span", { class: "badge accent" }, winner || "draw") : el("span", { class: "badge" }, "running")),
    el("td", { class: "muted" }, when(d.completed_at || d.started_at)));
}

function rounds(detail) {
  const [a, b] = detail.policies || ["a", "b"];
  return el("tr", {}, el("td", { colspan: 8 }, el("table", { class: "rounds" },
    el("thead", {}, el("tr", {}, ["seed", `${a}`, "reward", `${b}`, "reward", "winner"].map(h => el("th", {}, h)))),
    el("tbody", {}, (detail.rounds || []).map(r => el("tr", {},
      el("td", {}, r.seed), el("td", {}, r.rollout_ids?.[0] ? rolloutLink(r.rollout_ids[0]) : "–"),
      el("td", {}, num(r.rewards?.[0], 3)), el("td", {}, r.rollout_ids?.[1] ? rolloutLink(r.rollout_ids[1]) : "–"),
      el("td", {}, num(r.rewards?.[1], 3)),
      el("td", {}, el("span", { class: `badge ${r.winner === "void" ? "" : "accent"}` }, r.winner === "a" ? a : r.winner === "b" ? b : r.winner))))))));
}

export async function render(ctx) {
  const open = ctx.route.params.get("duel");
  const [board, duels, training, detail] = await Promise.all([
    api("leaderboard"), api("duels", { limit: 20 }), api("stats/training").catch(() => null),
    open ? api(`duels/${encodeURIComponent(open)}`) : Promise.resolve(null)]);
  const ratings = (board.ratings || []).slice().sort((x, y) => y.rating - x.rating);
  const body = [];
  for (const d of duels.duels || []) {
    body.push(duelRow(d, d.duel_id === open));
    if (detail && d.duel_id === open) body.push(rounds(detail));
  }
  if (detail && !(duels.duels || []).some(d => d.duel_id === open)) body.unshift(duelRow(detail, true), rounds(detail));
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Leaderboard"), el("span", { class: "muted" }, `${board.method || ""} · ${num(board.games, 0)} games`)),
    el("div", { class: "grid cols2" },
      card("Ratings (95% interval)", ratings.length ? [forest(ratings),
        el("table", { id: "ratings" }, el("thead", {}, el("tr", {}, ["policy", "rating", "interval", "games", "W", "L", "D"].map((h, i) => el("th", { class: i ? "num" : "" }, h)))),
          el("tbody", {}, ratings.map(r => el("tr", { "data-policy": r.policy }, el("td", {}, r.policy), el("td", { class: "num" }, num(r.rating, 0)),
            el("td", { class: "num" }, `${num(r.ci_low, 0)} – ${num(r.ci_high, 0)}`), el("td", { class: "num" }, num(r.games, 0)),
            el("td", { class: "num" }, num(r.wins, 0)), el("td", { class: "num" }, num(r.losses, 0)), el("td", { class: "num" }, num(r.draws, 0))))))]
        : empty("No duels decided yet: `arena duel` plays two policies on the same seeds.")),
      card("GRPO reward curve", training ? rewardCurve(training.reward_curve || [], training.reward_over_time || []) : empty("No policy versions yet."))),
    el("div", { style: "height:14px" }),
    card("Recent duels", (duels.duels || []).length || detail ? el("table", { id: "duels" }, el("thead", {}, el("tr", {},
      ["duel", "task", "policies", "wins", "draws", "void", "winner", "when"].map((h, i) => el("th", { class: [3, 4, 5].includes(i) ? "num" : "" }, h)))),
      el("tbody", {}, body)) : empty("No duels yet.")));
}
