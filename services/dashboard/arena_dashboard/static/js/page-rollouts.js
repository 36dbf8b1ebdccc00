// Rollouts: newest first with filters in the URL, live rows from the event stream, keyset paging.
import { api, card, el, empty, href, num, rolloutLink, stateBadge, when } from "./ui.js";

export const kind = "rollouts";
const FILTERS = ["task_id", "group_id", "state", "policy_version", "min_reward", "max_reward"];
const STATES = ["", "completed", "failed", "timed_out", "cancelled", "budget_exhausted"];

function filtersOf(params) {
  const f = {};
  for (const k of FILTERS) if (params.get(k)) f[k] = params.get(k);
  return f;
}

function matches(f, c) {
  if (f.task_id && c.task_id !== f.task_id) return false;
  if (f.group_id && c.group_id !== f.group_id) return false;
  if (f.state && c.to !== f.state) return false;
  if (f.policy_version) return false;  // not carried by state changes: wait for the next fetch
  if (f.min_reward && !(c.reward >= Number(f.min_reward))) return false;
  if (f.max_reward && !(c.reward <= Number(f.max_reward))) return false;
  return true;
}

// Why a row has no reward (docs/trajectory.md "One meaning of reward": Arena's outcome, or the
// rollout ended before it was verified), then its verification's flags.
function outcomeFlags(t) {
  const flags = [];
  if (t.infrastructure) flags.push("infrastructure");
  else if (t.verified === false && (t.reward === null || t.reward === undefined)) flags.push("unverified");
  return [...flags, ...(t.flags || [])].join(", ");
}

function reasonCell(reason) {
  const text = (reason || "").split("\n")[0];
  return el("td", { class: "muted", title: reason || "" }, text.length > 80 ? text.slice(0, 79) + "…" : text || "–");
}

function row(t, fresh = false) {
  return el("tr", { class: fresh ? "new" : "", "data-rollout": t.rollout_id },
    el("td", {}, rolloutLink(t.rollout_id)),
    el("td", {}, el("a", { href: href("rollouts", { task_id: t.task_id }) }, t.task_id)),
    el("td", {}, t.group_id ? el("a", { href: href("rollouts", { group_id: t.group_id }), class: "mono" },
      `${t.group_id} #${t.group_index ?? 0}`) : el("span", { class: "muted" }, "–")),
    el("td", {}, stateBadge(t.final_state || t.to)),
    el("td", { class: "num" }, t.reward === null || t.reward === undefined ? "–" : num(t.reward, 3)),
    reasonCell(t.reason),
    el("td", { class: "muted" }, outcomeFlags(t)),
    el("td", { class: "num" }, t.num_steps ?? t.steps ?? "–"),
    el("td", { class: "num" }, t.completion_tokens !== undefined ? num(t.completion_tokens, 0) : "–"),
    el("td", {}, (t.policy_versions || []).join(", ") || el("span", { class: "muted" }, "–")),
    el("td", { class: "muted" }, when(t.completed_at || t.at)));
}

export function live(ctx) {
  return {
    states: changes => {
      const body = document.getElementById("rollout-rows");
      if (!body || ctx.route.params.get("before_completed_at")) return;  // an older page stays as it is
      const f = filtersOf(ctx.route.params);
      for (const c of changes) {
        const existing = body.querySelector(`tr[data-rollout="${CSS.escape(c.rollout_id)}"]`);
        if (!matches(f, c) && !(existing && !f.state)) continue;
        const fresh = row({ ...c, final_state: c.to }, true);
        if (existing) existing.replaceWith(fresh); else body.prepend(fresh);
      }
      while (body.children.length > 200) body.lastElementChild.remove();
      document.getElementById("rollouts-empty")?.remove();
    },
  };
}

function filterForm(params) {
  const input = (name, placeholder, cls = "") => el("input", { name, placeholder, value: params.get(name) || "", class: cls });
  const state = el("select", { name: "state" }, STATES.map(s => el("option", { value: s, selected: s === (params.get("state") || "") },
    s ? s.replace("_", " ") : "any state")));
  const form = el("form", { class: "bar filters" },
    input("task_id", "task"), input("group_id", "group"), state, input("policy_version", "policy version"),
    input("min_reward", "reward ≥", "short"), input("max_reward", "reward ≤", "short"),
    el("button", { type: "submit", class: "primary" }, "Filter"),
    el("a", { href: "#/rollouts", class: "button" }, "Clear"));
  form.addEventListener("submit", ev => {
    ev.preventDefault();
    const f = {};
    for (const [k, v] of new FormData(form)) if (v) f[k] = v;
    location.hash = href("rollouts", f);
  });
  return form;
}

export async function render(ctx) {
  const { params } = ctx.route;
  const f = filtersOf(params);
  const page = { ...f, limit: 50, before_completed_at: params.get("before_completed_at") || "",
                 before_rollout: params.get("before_rollout") || "" };
  const { trajectories } = await api("trajectories", page);
  const body = el("tbody", { id: "rollout-rows" }, trajectories.map(t => row(t)));
  const last = trajectories[trajectories.length - 1];
  const older = trajectories.length === 50 && last
    ? el("a", { class: "button", href: href("rollouts", { ...f, before_completed_at: last.completed_at, before_rollout: last.rollout_id }) }, "Older →")
    : null;
  const newest = params.get("before_completed_at") ? el("a", { class: "button", href: href("rollouts", f) }, "← Newest") : null;
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Rollouts"), el("span", { class: "muted" },
      params.get("before_completed_at") ? "older page" : "newest first · live")),
    filterForm(params),
    card(null,
      el("table", {}, el("thead", {}, el("tr", {}, ["rollout", "task", "group", "state", "reward", "reason", "flags", "steps",
        "completion tokens", "policy", "ended"].map((h, i) => el("th", { class: [4, 7, 8].includes(i) ? "num" : "" }, h)))), body),
      trajectories.length ? null : el("div", { class: "empty", id: "rollouts-empty" }, "No rollouts match yet; new ones appear here as they end."),
      el("div", { class: "pager" }, newest, older)));
}
