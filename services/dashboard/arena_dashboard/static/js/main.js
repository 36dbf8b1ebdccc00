// The single-page app: the hash is the view (#/<page>[/<id>]?<params>); each page module
// renders into <main> and may follow live events until the next view replaces it.
import { destroyCharts, el, errorBox, parseHash } from "./ui.js";
import { live } from "./live.js";
import * as overview from "./page-overview.js";
import * as rollouts from "./page-rollouts.js";
import * as rollout from "./page-rollout.js";
import * as verify from "./page-verify.js";
import * as tokens from "./page-tokens.js";
import * as training from "./page-training.js";
import * as tasks from "./page-tasks.js";
import * as leaderboard from "./page-leaderboard.js";
import * as evals from "./page-evals.js";

const PAGES = { overview, rollouts, rollout, verify, tokens, training, tasks, leaderboard, evals };
const NAV_OF = { rollout: "rollouts" };

let current = null;  // { unsubscribe: [...], kind }
let generation = 0;

async function render() {
  const route = parseHash();
  const page = PAGES[route.page];
  const root = document.getElementById("view");
  for (const off of current?.unsubscribe || []) off();
  destroyCharts();
  const mine = ++generation;
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.dataset.page === (NAV_OF[route.page] || route.page));
  }
  if (!page) { root.replaceChildren(errorBox({ code: "not_found", message: `no page ${route.page}` })); return; }
  document.title = `Arena · ${route.page}`;
  const ctx = { route, isCurrent: () => mine === generation };
  current = { unsubscribe: [] };
  const view = el("div", { class: "page", "data-page": route.page }, el("div", { class: "empty" }, "Loading…"));
  root.replaceChildren(view);
  const draw = async () => {
    if (!ctx.isCurrent()) return;
    try {
      const node = await page.render(ctx);
      if (!ctx.isCurrent()) return;
      destroyCharts();
      view.replaceChildren(node);
      view.dataset.loaded = String(Date.now());
    } catch (e) {
      if (ctx.isCurrent()) view.replaceChildren(errorBox(e));
    }
  };
  ctx.redraw = draw;
  const hooks = page.live ? page.live(ctx) : {};
  for (const [kind, fn] of Object.entries(hooks)) current.unsubscribe.push(live.on(kind, fn));
  if (page.kind) {
    current.unsubscribe.push(live.on("refresh", kinds => { if (kinds.includes(page.kind)) draw(); }));
  }
  await draw();
}

window.addEventListener("hashchange", render);
live.start();
render();
