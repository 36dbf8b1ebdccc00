// Per-token overlays: a strip of tokens coloured by logprob, advantage or trainer-vs-inference
// mismatch, the loss mask dimming context tokens; hover shows id, logprobs and the top-k.
import { el, num, tip } from "./ui.js";

// Token text: the backend's own strings where it sent top-k (the sampled token among them), the
// completion's bytes when ids map one-to-one onto them (byte-level vocabularies), else the id.
export function vocabulary(steps) {
  const vocab = new Map();
  for (const s of steps) {
    const ids = s.completion_token_ids || [];
    (s.top_logprobs || []).forEach((alts, i) => {
      for (const a of alts || []) {
        if (a.token_id !== null && a.token_id !== undefined) vocab.set(a.token_id, a.token);
        else if (s.logprobs && a.logprob === s.logprobs[i] && ids[i] !== undefined) vocab.set(ids[i], a.token);  // the sampled one
      }
    });
    const bytes = new TextEncoder().encode(s.completion_text || "");
    if (ids.length && bytes.length === ids.length) {
      ids.forEach((id, i) => { if (!vocab.has(id)) vocab.set(id, byteText(bytes[i])); });
    }
  }
  return vocab;
}

function byteText(b) {
  if (b === 10) return "\n";
  if (b === 9) return "\t";
  if (b >= 32 && b < 127) return String.fromCharCode(b);
  return `\\x${b.toString(16).padStart(2, "0")}`;
}

function textOf(vocab, id) { return vocab.has(id) ? vocab.get(id) : `⟨${id}⟩`; }

function clamp(x) { return Math.max(0, Math.min(1, x)); }

function colour(t, mode) {
  if (mode === "advantage") {
    if (t.adv === null || t.adv === undefined || !t.mask) return "transparent";
    const a = clamp(Math.abs(t.adv) / 1.5) * 0.5 + 0.08;
    return t.adv >= 0 ? `rgba(35,128,74,${a})` : `rgba(194,59,59,${a})`;
  }
  if (mode === "mismatch") {
    if (t.trainer === null || t.trainer === undefined || t.lp === null || t.lp === undefined) return "transparent";
    return `rgba(181,138,27,${clamp(Math.abs(t.trainer - t.lp) / 0.5) * 0.7})`;
  }
  if (t.lp === null || t.lp === undefined) return "transparent";
  return `rgba(194,59,59,${clamp(-t.lp / 4) * 0.6})`;
}

// The trainer-vs-inference gap: a float-rounding gap (1e-8) in exponent form, not as "-0".
function gap(d) {
  return d && Math.abs(d) < 1e-4 ? d.toExponential(1) : num(d, 4);
}

function showTip(ev, t) {
  const node = tip();
  const rows = [["token id", t.id], ["text", JSON.stringify(t.text)]];
  if (t.lp !== null && t.lp !== undefined) rows.push(["logprob", num(t.lp, 4)], ["prob", num(Math.exp(t.lp), 4)]);
  if (t.trainer !== null && t.trainer !== undefined) rows.push(["trainer logprob", num(t.trainer, 4)], ["Δ", gap(t.trainer - (t.lp ?? 0))]);
  if (t.mask !== undefined) rows.push(["loss mask", t.mask]);
  if (t.adv !== null && t.adv !== undefined) rows.push(["advantage", num(t.adv, 3)]);
  const top = (t.top || []).map(a => [JSON.stringify(a.token), num(a.logprob, 3)]);
  node.replaceChildren(...[
    el("table", {}, rows.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, String(v))))),
    top.length ? el("div", { style: "margin-top:4px;opacity:.8" }, "top logprobs") : null,
    top.length ? el("table", {}, top.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, v)))) : null].filter(Boolean));
  node.style.display = "block";
  node.style.left = Math.min(ev.clientX + 14, window.innerWidth - 330) + "px";
  node.style.top = (ev.clientY + 16) + "px";
}

export function strip(tokens, { mode = "logprob", showMask = false } = {}) {
  const box = el("div", { class: "tokens" });
  for (const t of tokens) {
    const span = el("span", { class: `tok${showMask && t.mask === 0 ? " masked" : ""}`, "data-id": t.id }, t.text);
    span.style.background = showMask && t.mask === 0 ? "transparent" : colour(t, mode);
    span.addEventListener("mousemove", ev => showTip(ev, t));
    span.addEventListener("mouseleave", () => { tip().style.display = "none"; });
    box.append(span);
  }
  return box;
}

export function stepTokens(step, vocab, advantage = null) {
  const ids = step.completion_token_ids || [];
  return ids.map((id, i) => ({ id, text: textOf(vocab, id), lp: step.logprobs ? step.logprobs[i] : null,
                               top: step.top_logprobs ? step.top_logprobs[i] : null, adv: advantage, mask: 1 }));
}

export function sequenceTokens(seq, vocab, advantage, trainer) {
  return seq.token_ids.map((id, i) => ({
    id, text: textOf(vocab, id), mask: seq.loss_mask[i],
    lp: seq.loss_mask[i] ? seq.logprobs[i] : null,
    adv: seq.loss_mask[i] ? advantage : null,
    trainer: trainer && seq.loss_mask[i] && trainer[i] !== undefined ? trainer[i] : null,
  }));
}

export function legend(mode) {
  const text = { logprob: ["likely", "unlikely (low logprob)"], advantage: ["negative", "positive advantage"],
                 mismatch: ["agree", "trainer and inference disagree"] }[mode];
  const ramp = { logprob: "linear-gradient(90deg, rgba(194,59,59,0), rgba(194,59,59,.6))",
                 advantage: "linear-gradient(90deg, rgba(194,59,59,.55), rgba(255,255,255,0), rgba(35,128,74,.55))",
                 mismatch: "linear-gradient(90deg, rgba(181,138,27,0), rgba(181,138,27,.7))" }[mode];
  return el("span", { class: "legend" }, text[0], el("span", { class: "ramp", style: `background:${ramp}` }), text[1]);
}
