// Small DOM, formatting, routing and chart helpers shared by the pages.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// ---- routing: #/<page>[/<id>]?<params>

export function parseHash(hash = location.hash) {
  const raw = hash.replace(/^#\/?/, "");
  const [path, query = ""] = raw.split("?");
  const [page, ...rest] = path.split("/");
  return { page: page || "overview", id: rest.length ? decodeURIComponent(rest.join("/")) : null,
           params: new URLSearchParams(query) };
}

export function href(page, params = {}, id = null) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
  const qs = q.toString();
  return `#/${page}${id ? "/" + encodeURIComponent(id) : ""}${qs ? "?" + qs : ""}`;
}

export function rolloutLink(id, text = null) {
  return el("a", { href: href("rollout", {}, id), class: "mono" }, text || id);
}

// ---- the /api client

export class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

export async function api(path, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
  const url = `/api/${path}${[...q].length ? "?" + q : ""}`;
  let resp;
  try { resp = await fetch(url, { credentials: "same-origin", headers: { accept: "application/json" } }); }
  catch (e) { throw new ApiError(0, "network", `the dashboard is unreachable (${e.message})`); }
  let body = null;
  try { body = await resp.json(); } catch { /* not JSON */ }
  if (!resp.ok) {
    if (resp.status === 401) { location.reload(); }
    const err = body && body.error ? body.error : { code: "http_" + resp.status, message: `HTTP ${resp.status}` };
    throw new ApiError(resp.status, err.code, err.message);
  }
  return body;
}

export function errorBox(e) {
  return el("div", { class: "error" }, `${e.code ? e.code + ": " : ""}${e.message}`);
}

// ---- formatting

export const nf = new Intl.NumberFormat(undefined, { maximumFractionDigits: 2 });
export function num(v, digits = 2) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toLocaleString(undefined, { maximumFractionDigits: digits });
}
export function pct(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return (100 * v).toFixed(digits) + "%";
}
export function ms(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (v >= 60000) return (v / 60000).toFixed(1) + " min";
  if (v >= 1000) return (v / 1000).toFixed(v >= 10000 ? 0 : 1) + " s";
  return Math.round(v) + " ms";
}
export function when(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  const age = Date.now() / 1000 - t;
  if (age < 60) return `${Math.max(0, Math.round(age))} s ago`;
  if (age < 3600) return `${Math.round(age / 60)} min ago`;
  return d.toLocaleString();
}
export function signed(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return (v > 0 ? "+" : "") + Number(v).toFixed(digits);
}

export function stateBadge(state) {
  const cls = state === "completed" ? "good" : ["failed", "timed_out", "budget_exhausted"].includes(state) ? "bad"
    : ["running", "verifying", "provisioning", "pending"].includes(state) ? "accent" : "";
  return el("span", { class: `badge ${cls}` }, (state || "?").replace("_", " "));
}

export function tile(label, value, sub = null, extra = "") {
  return el("div", { class: `card tile ${extra}` }, el("div", { class: "label" }, label),
    el("div", { class: "value" }, value), sub ? el("div", { class: "sub" }, sub) : null);
}

export function card(title, ...children) {
  return el("section", { class: "card" }, title ? el("h2", {}, title) : null, ...children);
}

export function table(headers, rows, { numeric = [] } = {}) {
  const head = el("tr", {}, headers.map((h, i) => el("th", { class: numeric.includes(i) ? "num" : "" }, h)));
  const body = rows.map(r => el("tr", {}, r.map((c, i) => el("td", { class: numeric.includes(i) ? "num" : "" }, c))));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, body));
}

export function empty(text) { return el("div", { class: "empty" }, text); }

// ---- charts (Chart.js, vendored; no animation: pages re-render on live refreshes)

export const ACCENT = "#2f5bea";
export const PALETTE = ["#2f5bea", "#8a94a8", "#1d2330", "#7b9cf5", "#c23b3b", "#23804a", "#b58a1b", "#5c6b8a"];

const charts = new Set();
export function destroyCharts() { for (const c of charts) c.destroy(); charts.clear(); }

export function chart(kind, data, options = {}, { tall = false } = {}) {
  const canvas = el("canvas");
  const box = el("div", { class: `chart${tall ? " tall" : ""}` }, canvas);
  const base = {
    animation: false, responsive: true, maintainAspectRatio: false,
    plugins: { legend: { display: (data.datasets || []).length > 1, labels: { boxWidth: 12, color: "#1d2330" } },
               tooltip: { intersect: false, mode: "index" } },
    scales: kind === "pie" || kind === "doughnut" ? {} : {
      x: { grid: { color: "#eef0f4" }, ticks: { color: "#6b7385", maxRotation: 0, autoSkip: true } },
      y: { grid: { color: "#eef0f4" }, ticks: { color: "#6b7385" }, beginAtZero: true } },
  };
  const merged = deepMerge(base, options);
  requestAnimationFrame(() => {
    if (!canvas.isConnected || typeof Chart === "undefined") return;
    const c = new Chart(canvas, { type: kind, data, options: merged });
    charts.add(c);
  });
  return box;
}

function deepMerge(a, b) {
  const out = { ...a };
  for (const [k, v] of Object.entries(b)) {
    out[k] = v && typeof v === "object" && !Array.isArray(v) && a[k] && typeof a[k] === "object" ? deepMerge(a[k], v) : v;
  }
  return out;
}

export function dataset(label, data, i = 0, extra = {}) {
  const color = PALETTE[i % PALETTE.length];
  return { label, data, borderColor: color, backgroundColor: color + (extra.fill ? "33" : "cc"), borderWidth: 2,
           pointRadius: 2, tension: 0.15, ...extra };
}

// A tooltip that follows the mouse (token overlay).
export function tip() {
  let node = document.getElementById("tip");
  if (!node) { node = el("div", { id: "tip" }); document.body.append(node); }
  return node;
}
