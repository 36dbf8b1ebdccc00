// One rollout: state timeline, every LLM call with its token overlay, the training sequences,
// the final diff, the verifier's verdict, tests, flags and log.
import { ApiError, api, card, el, href, ms, num, stateBadge, table, when } from "./ui.js";
import { legend, sequenceTokens, stepTokens, strip, vocabulary } from "./tokens.js";

export function live(ctx) {
  return {
    states: changes => {
      if (changes.some(c => c.rollout_id === ctx.route.id && c.final)) setTimeout(ctx.redraw, 1500);
      const pending = document.getElementById("rollout-pending-state");
      const mine = changes.filter(c => c.rollout_id === ctx.route.id);
      if (pending && mine.length) pending.replaceChildren(stateBadge(mine[mine.length - 1].to));
    },
  };
}

function timeline(history) {
  if (!history || !history.length) return el("p", { class: "muted" }, "No transitions recorded.");
  const t0 = history[0].at;
  return el("div", { class: "timeline" }, history.map((h, i) => el("div", { class: `st${i === history.length - 1 ? " final" : ""}`, title: h.reason || "" },
    el("b", {}, h.to_state.replace("_", " ")), el("small", {}, i ? `+${((h.at - t0)).toFixed(2)} s` : new Date(h.at * 1000).toLocaleTimeString()),
    h.reason ? el("small", { style: "display:block;max-width:260px" }, h.reason.slice(0, 120)) : null)));
}

function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map(p => (p && p.text) || (p && p.type ? `[${p.type}]` : "")).join("");
  return content === null || content === undefined ? "" : JSON.stringify(content);
}

function message(m) {
  const calls = (m.tool_calls || []).map(c => `→ ${c.function?.name || c.name}(${c.function?.arguments || c.arguments || ""})`);
  return el("div", { class: `msg ${m.role}` }, el("span", { class: "role" }, m.role + (m.name ? ` · ${m.name}` : "")),
    contentText(m.content), calls.length ? "\n" + calls.join("\n") : "");
}

function sampling(s) {
  const keys = Object.entries(s || {}).filter(([, v]) => v !== null && v !== undefined);
  return keys.length ? keys.map(([k, v]) => `${k}=${Array.isArray(v) ? JSON.stringify(v) : v}`).join("  ") : "backend defaults";
}

// An OpenEnv episode (docs/openenv.md): every reset and step as the sandbox relayed it.
function envSteps(sandbox) {
  const steps = sandbox?.env_steps || [];
  if (!steps.length) return null;
  const short = v => { const s = JSON.stringify(v ?? {}); return s.length > 300 ? s.slice(0, 300) + "…" : s; };
  return el("div", {}, el("div", { style: "height:14px" }),
    card(`Environment episode (${steps.length} exchanges)`,
      el("p", { class: "muted" }, "OpenEnv frames as the sandbox relayed them: index 0 is the reset."),
      table(["#", "kind", "action", "observation", "reward", "done", "ms"], steps.map(s => [
        s.index, s.kind, el("span", { class: "mono" }, short(s.action)),
        s.error ? el("span", { class: "badge bad" }, s.error) : el("span", { class: "mono" }, short(s.observation) + (s.truncated ? " (cut)" : "")),
        s.reward === null || s.reward === undefined ? "–" : num(s.reward, 3), s.done ? "yes" : "", num(s.duration_ms ?? 0, 0)]),
        { numeric: [0, 4, 6] })));
}

function diffView(diff) {
  return el("pre", {}, (diff || "").split("\n").map(line => el("span", {
    class: line.startsWith("+") && !line.startsWith("+++") ? "add" : line.startsWith("-") && !line.startsWith("---") ? "del"
      : line.startsWith("@@") ? "hunk" : "" }, line + "\n")));
}

function stepCard(step, vocab, opts) {
  const t = step.timings || {};
  const tools = step.tools || [];
  return el("div", { class: "step", "data-step": step.step_index },
    el("h2", {}, `LLM call ${step.step_index}`, " ", el("span", { class: "badge" }, step.api),
      step.error ? el("span", { class: "badge bad" }, "error") : null, step.abandoned ? el("span", { class: "badge bad" }, "abandoned") : null),
    el("dl", { class: "kv" },
      el("dt", {}, "model"), el("dd", {}, step.model),
      el("dt", {}, "backend replica"), el("dd", { class: "mono" }, step.backend_replica || step.backend || "–"),
      el("dt", {}, "policy version"), el("dd", {}, step.policy_version ?? "–"),
      el("dt", {}, "sampling applied"), el("dd", { class: "mono" }, sampling(step.sampling)),
      el("dt", {}, "timings"), el("dd", {}, `queued ${ms(t.queued_ms)} · first token ${ms(t.first_token_ms)} · total ${ms(t.total_ms)}`),
      el("dt", {}, "tokens"), el("dd", {}, `prompt ${num(step.usage?.prompt_tokens, 0)} · completion ${num(step.usage?.completion_tokens, 0)} · ids from ${step.token_ids_source || "backend"}`),
      el("dt", {}, "finish"), el("dd", {}, step.finish_reason || "–"),
      step.error ? el("dt", {}, "error") : null, step.error ? el("dd", { class: "down" }, step.error) : null),
    el("details", {}, el("summary", {}, `request: ${(step.request_messages || []).length} messages`),
      (step.request_messages || []).map(message)),
    el("details", {}, el("summary", {}, `tools offered: ${tools.length ? tools.map(x => x.function?.name || x.name).join(", ") : "none"}`),
      tools.length ? el("pre", {}, JSON.stringify(tools, null, 2)) : null),
    (step.tool_calls || []).length ? el("div", {}, el("b", {}, "tool calls: "),
      step.tool_calls.map(c => el("code", {}, `${c.name}(${c.arguments}) `))) : null,
    el("div", { class: "muted", style: "margin-top:8px" }, "completion, token by token"),
    (step.completion_token_ids || []).length
      ? strip(stepTokens(step, vocab, opts.advantage), { mode: opts.mode === "mismatch" ? "logprob" : opts.mode })
      : el("div", { class: "msg assistant" }, step.completion_text || "(no tokens captured)"));
}

function verification(v) {
  if (!v) return card("Verification", el("p", { class: "muted" }, "Not verified (the rollout ended before verification)."));
  const c = v.counts || {};
  return card("Verification",
    el("div", { class: "bar" }, el("span", { class: `badge ${v.passed ? "good" : "bad"}` }, v.passed ? "passed" : "not passed"),
      el("span", {}, `reward ${v.reward === null ? "– (infrastructure)" : num(v.reward, 3)}`),
      el("span", { class: "muted" }, `${v.verifier}${v.parser ? " · parser " + v.parser : ""} · ${ms((v.finished_at - v.started_at) * 1000)}`),
      ...(v.flags || []).map(f => el("a", { href: href("verify"), class: "badge bad", "data-flag": f }, f))),
    v.error ? el("div", { class: "error" }, v.error) : null,
    v.reason ? el("p", {}, v.reason) : null,
    el("p", {}, `FAIL_TO_PASS ${c.f2p_passed ?? 0}/${(c.f2p_passed ?? 0) + (c.f2p_failed ?? 0)} · PASS_TO_PASS ${c.p2p_passed ?? 0}/${(c.p2p_passed ?? 0) + (c.p2p_failed ?? 0)}`),
    (v.tests || []).length ? table(["test", "status"], v.tests.map(t => [el("code", {}, t.test_id),
      el("span", { class: `badge ${t.status === "passed" ? "good" : t.status === "failed" || t.status === "error" ? "bad" : ""}` }, t.status)])) : null,
    Object.keys(v.components || {}).length ? el("p", { class: "muted" }, "components: " + Object.entries(v.components).map(([k, x]) => `${k} ${num(x, 3)}`).join(", ")) : null,
    v.log_tail ? el("details", {}, el("summary", {}, "verifier log"), el("pre", {}, v.log_tail)) : null);
}

export async function render(ctx) {
  const id = ctx.route.id;
  let data;
  try { data = await api(`rollout/${encodeURIComponent(id)}`); }
  catch (e) {
    if (e instanceof ApiError && e.status === 404) {
      return el("div", {}, el("h1", {}, "Rollout ", el("span", { class: "mono" }, id)),
        card(null, el("p", {}, "No trajectory stored for this rollout yet: it is still running, or the id is unknown. ",
          "This page loads it by itself once it ends. Current state: ", el("span", { id: "rollout-pending-state" }, "–"))));
    }
    throw e;
  }
  const t = data.trajectory;
  const params = ctx.route.params;
  const mode = params.get("colour") || "logprob";
  const showMask = params.get("mask") !== "0";
  const vocab = vocabulary(t.steps || []);
  const group = data.group;
  const advantage = group && group.rollout_ids ? group.advantages[group.rollout_ids.indexOf(t.rollout_id)] : null;
  const trainerBySeq = new Map((data.trainer_logprobs?.sequences || []).map(s => [s.sequence_index, s.logprobs]));
  const setOpt = (k, v) => { const p = new URLSearchParams(params); p.set(k, v); location.hash = `#/rollout/${encodeURIComponent(id)}?${p}`; };
  const radio = (value, label, disabled = false) => el("label", {}, el("input", { type: "radio", name: "colour", value, checked: mode === value, disabled,
    onchange: () => setOpt("colour", value) }), " ", label);
  const toggles = el("div", { class: "toggles" }, el("b", {}, "colour by"), radio("logprob", "logprob"),
    radio("advantage", `advantage${advantage === null || advantage === undefined ? " (no group)" : ` (${num(advantage, 3)})`}`, advantage === null || advantage === undefined),
    radio("mismatch", `trainer vs inference${trainerBySeq.size ? "" : " (no trainer logprobs)"}`, !trainerBySeq.size),
    el("label", {}, el("input", { type: "checkbox", checked: showMask, onchange: ev => setOpt("mask", ev.target.checked ? "1" : "0") }), " loss mask"),
    legend(mode));
  const seqs = t.sequences || [];
  return el("div", {},
    el("div", { class: "bar" }, el("h1", {}, "Rollout ", el("span", { class: "mono" }, t.rollout_id)), stateBadge(t.final_state),
      el("span", {}, "reward ", el("b", {}, t.reward === null ? "–" : num(t.reward, 3))),
      el("a", { href: href("rollouts", { task_id: t.task_id }) }, t.task_id),
      t.group_id ? el("a", { href: href("rollouts", { group_id: t.group_id }), class: "mono" }, `group ${t.group_id} #${t.group_index ?? 0}`) : null,
      el("span", { class: "muted" }, `policy ${(t.policy_versions || []).join(", ") || "–"} · ended ${when(t.completed_at)}`)),
    t.reason ? el("p", { class: "muted" }, `ended: ${t.reason}`) : null,
    (data.problems || []).map(p => el("div", { class: "error" }, p)),
    card("State timeline", timeline(t.history)),
    el("div", { style: "height:14px" }),
    card(`LLM calls (${(t.steps || []).length})`, toggles, (t.steps || []).map(s => stepCard(s, vocab, { mode, advantage }))),
    el("div", { style: "height:14px" }),
    seqs.length ? card(`Training sequences (${seqs.length})`,
      el("p", { class: "muted" }, "What a trainer consumes: the token ids as sampled, loss mask 1 on the policy's tokens. ",
        group ? `Group advantage of this rollout: ${num(advantage, 3)} (rewards ${group.rewards.map(r => r === null ? "–" : num(r, 2)).join(", ")}).` : ""),
      seqs.map((s, i) => el("div", { class: "step", "data-sequence": i },
        el("div", { class: "muted" }, `sequence ${i}: ${s.token_ids.length} tokens, ${s.loss_mask.filter(x => x).length} trained, steps ${s.step_indexes.join(", ")}`),
        strip(sequenceTokens(s, vocab, advantage, trainerBySeq.get(i)), { mode, showMask })))) : null,
    envSteps(t.sandbox),
    (t.sequence_breaks || []).length ? card("Sequence breaks", table(["step", "kind", "reason"], t.sequence_breaks.map(b => [b.step_index, b.kind, b.reason]))) : null,
    el("div", { style: "height:14px" }),
    el("div", { class: "grid cols2" },
      verification(t.verification),
      card("Sandbox", t.sandbox ? el("div", {},
        el("p", {}, el("span", { class: "badge" }, t.sandbox.outcome), " ", `exit ${t.sandbox.exit_code ?? "–"} · ${t.sandbox.provider} · ${ms((t.sandbox.finished_at - t.sandbox.started_at) * 1000)}`,
          ...(t.sandbox.flags || []).map(f => el("span", { class: "badge bad" }, f))),
        el("div", { class: "muted" }, "final diff"), t.sandbox.diff ? diffView(t.sandbox.diff) : el("p", { class: "muted" }, "(no change)"),
        t.sandbox.log_tail ? el("details", {}, el("summary", {}, "agent log"), el("pre", {}, t.sandbox.log_tail)) : null)
        : el("p", { class: "muted" }, "No sandbox ran."))));
}
