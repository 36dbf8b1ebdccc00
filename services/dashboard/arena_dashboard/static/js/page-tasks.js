// Tasks: attempts, success rate, reward variance, saturated / never-solved badges; sortable.
import { api, card, el, empty, href, num, pct, when } from "./ui.js";

export const kind = "tasks";
const COLUMNS = [["task_id", "task"], ["attempts", "attempts"], [null, "passed"], ["success_rate", "success rate"],
                 [null, "mean reward"], ["reward_variance", "reward variance"], [null, ""], ["last_seen", "last seen"]];
const PAGE = 100;

export async function render(ctx) {
  const { params } = ctx.route;
  const order = params.get("order") || "attempts";
  const offset = Number(params.get("offset") || 0);
  const d = await api("stats/tasks", { order, limit: PAGE, offset, min_attempts: params.get("min_attempts") || "" });
  const head = el("tr", {}, COLUMNS.map(([key, label], i) => el("th", { class: [1, 2, 3, 4, 5].includes(i) ? "num" : "" },
    key ? el("a", { href: href("tasks", { order: key }), class: key === order ? "on" : "" }, label + (key === order ? " ↓" : "")) : label)));
  const rows = (d.rows || []).map(r => el("tr", { "data-task": r.task_id },
    el("td", {}, el("a", { href: href("rollouts", { task_id: r.task_id }) }, r.task_id)),
    el("td", { class: "num" }, num(r.attempts, 0)), el("td", { class: "num" }, num(r.passed, 0)),
    el("td", { class: "num" }, pct(r.success_rate)), el("td", { class: "num" }, num(r.mean_reward, 3)),
    el("td", { class: "num" }, num(r.reward_variance, 4)),
    el("td", {}, r.saturated ? el("span", { class: "badge accent", title: "every attempt passes: no signal left" }, "saturated") : null,
      r.never_solved ? el("span", { class: "badge bad", title: "no attempt ever passed" }, "never solved") : null),
    el("td", { class: "muted" }, when(r.last_seen))));
  const pager = el("div", { class: "pager" },
    offset > 0 ? el("a", { class: "button", href: href("tasks", { order, offset: Math.max(0, offset - PAGE) }) }, "← Previous") : null,
    offset + PAGE < (d.total || 0) ? el("a", { class: "button", href: href("tasks", { order, offset: offset + PAGE }) }, "Next →") : null);
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Tasks"), el("span", { class: "muted" }, `${num(d.total, 0)} tasks`)),
    card(null, rows.length ? el("table", { id: "tasks" }, el("thead", {}, head), el("tbody", {}, rows)) : empty("No tasks attempted yet."), pager));
}
