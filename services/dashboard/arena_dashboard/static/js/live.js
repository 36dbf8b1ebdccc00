// The live connection: one EventSource per tab (/events). Counters seed from /api/stats/live
// when the stream opens (and re-open), then follow the state changes it carries.
import { api } from "./ui.js";

const ACTIVE = { pending: "queued", provisioning: "queued", running: "running", verifying: "verifying" };

export class Live {
  constructor() {
    this.listeners = { states: new Set(), refresh: new Set(), trainer: new Set(), duel: new Set(), counters: new Set() };
    this.counters = { running: null, queued: null, verifying: null };
    this.seedAt = 0;
    this.connected = false;
    this.source = null;
  }

  on(kind, fn) { this.listeners[kind].add(fn); return () => this.listeners[kind].delete(fn); }
  emit(kind, data) { for (const fn of this.listeners[kind]) { try { fn(data); } catch (e) { console.error(e); } } }

  start() {
    const source = new EventSource("/events");
    this.source = source;
    source.addEventListener("hello", () => { this.setConnected(true); this.seed(); });
    source.addEventListener("states", ev => this.onStates(JSON.parse(ev.data)));
    source.addEventListener("refresh", ev => this.emit("refresh", JSON.parse(ev.data).kinds));
    source.addEventListener("trainer", ev => this.emit("trainer", JSON.parse(ev.data)));
    source.addEventListener("duel", ev => this.emit("duel", JSON.parse(ev.data)));
    source.addEventListener("reseed", () => this.seed());  // the dashboard's NATS connection came back
    const restart = () => { source.close(); this.setConnected(false); setTimeout(() => this.start(), 1000); };
    source.addEventListener("dropped", restart);
    source.addEventListener("closing", restart);
    source.onerror = () => this.setConnected(false);  // EventSource reconnects by itself
  }

  setConnected(on) {
    this.connected = on;
    document.getElementById("live-dot")?.classList.toggle("on", on);
  }

  async seed() {
    try {
      const live = await api("stats/live");
      this.seedAt = live.at || Date.now() / 1000;
      this.counters = { running: live.running ?? 0, queued: (live.pending ?? 0) + (live.provisioning ?? 0),
                        verifying: live.verifying ?? 0 };
      this.emit("counters", this.counters);
    } catch (e) { console.warn("live counters:", e.message); }
  }

  onStates(body) {
    const changes = body.changes || [];
    if (this.counters.running !== null) {
      for (const c of changes) {
        if (c.at <= this.seedAt) continue;  // already counted in the seed
        const from = ACTIVE[c.from], to = ACTIVE[c.to];
        if (from) this.counters[from] = Math.max(0, this.counters[from] - 1);
        if (to) this.counters[to] += 1;
      }
      this.emit("counters", this.counters);
    }
    if (body.overflow) this.seed();  // too many to list: the counters come from the source again
    this.emit("states", changes);
  }
}

export const live = new Live();

live.on("counters", c => {
  for (const k of ["running", "queued", "verifying"]) {
    const node = document.getElementById(`live-${k}`);
    if (node) node.textContent = c[k] ?? "–";
  }
});
