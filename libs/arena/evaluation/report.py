"""An evaluation job's report: per model pass@k and pass^k for every k up to the job's, mean reward
(each with its 95% interval), paired comparisons of every two models, Bradley–Terry ratings, cost
per task and in total; as a table, Markdown, JSON and one self-contained HTML page (docs/evaluation.md).
"""

from __future__ import annotations

import html
import itertools
import math
from pathlib import Path

import msgspec
import numpy as np

from arena.evaluation import stats
from arena.evaluation.cost import CostSummary, read_prices, summarize_cost
from arena.evaluation.records import EvalSpec, read_spec
from arena.evaluation.versions import GradingVersion, graded, read_versions, report_stem
from arena_core.ratings import Rating


class TaskCell(msgspec.Struct, kw_only=True):
    """One task for one model: ``n`` attempts with a verdict (infrastructure outcomes left out),
    ``successes`` of them, their mean reward, and what all the task's tries cost."""

    task_id: str
    model: str
    n: int
    successes: int
    infrastructure: int
    mean_reward: float | None
    pass_at_k: float | None  # at the job's k
    rewards: list[float | None]  # by attempt index (None: no verdict)
    cost: CostSummary


class ModelSummary(msgspec.Struct, kw_only=True):
    """A model over the job's tasks. ``pass_at[k]`` / ``pass_hat[k]`` for k = 1..K (means over the
    tasks with at least k attempts with a verdict)."""

    model: str
    attempts: int
    completed: int
    failed: int
    infrastructure: int  # attempts still an infrastructure outcome after their retries: left out
    unsettled: int  # attempts with no finished try yet (resume the job)
    mean_reward: stats.Estimate
    pass_at: dict[int, stats.Estimate]
    pass_hat: dict[int, stats.Estimate]
    cost: CostSummary


class EvalReport(msgspec.Struct, kw_only=True):
    spec: EvalSpec
    models: list[ModelSummary]
    comparisons: list[stats.PairedComparison]
    ratings: list[Rating]
    tasks: list[TaskCell]
    cost: CostSummary  # every try of the job
    prices: str | None  # the price table's path, if one was given
    grading: GradingVersion | None = None  # the grading version reported (None: 1, the original verdicts)


def build(directory: Path, prices_path: str | None = None, version: int = 1) -> EvalReport:
    """The report of the job in ``directory`` as its log stands (a running job: what is settled),
    graded as its grading ``version`` grades it (1: as its rollouts were verified; versions.py)."""
    spec = read_spec(directory)
    prices = read_prices(prices_path)
    final, tries = graded(directory, version)
    threshold = spec.success_threshold
    task_ids = [t.task_id for t in spec.tasks]

    cells: list[TaskCell] = []
    rewards: dict[str, dict[str, list[float | None]]] = {m: {} for m in spec.models}
    for model in spec.models:
        for task_id in task_ids:
            row: list[float | None] = []
            infra = 0
            for i in range(spec.k):
                r = final.get((task_id, model, i))
                if r is None or r.outcome == "infrastructure":
                    infra += r is not None
                    row.append(None)
                else:
                    row.append(0.0 if r.reward is None else r.reward)
            rewards[model][task_id] = row
            got = [x for x in row if x is not None]
            n, c = len(got), sum(x >= threshold for x in got)
            at_k = float(stats.pass_at_k(n, c, spec.k)) if n >= spec.k else None
            cells.append(TaskCell(task_id=task_id, model=model, n=n, successes=c, infrastructure=infra,
                                  mean_reward=float(np.mean(got)) if got else None, pass_at_k=at_k, rewards=row,
                                  cost=summarize_cost([t for t in tries if t.task_id == task_id and t.model == model],
                                                      prices)))

    summaries = []
    per_task: dict[str, dict[str, dict[str, float]]] = {}  # model -> metric -> task -> value
    for model in spec.models:
        mine = [c for c in cells if c.model == model]
        n = np.array([c.n for c in mine])
        s = np.array([c.successes for c in mine])
        mean = np.array([np.nan if c.mean_reward is None else c.mean_reward for c in mine])
        metrics = {"mean reward": dict(zip(task_ids, mean))}
        pass_at, pass_hat = {}, {}
        for k in range(1, spec.k + 1):
            at, hat = stats.pass_at_k(n, s, k), stats.pass_hat_k(n, s, k)
            pass_at[k] = stats.mean_with_interval(at)
            pass_hat[k] = stats.mean_with_interval(hat)
            if k in (1, spec.k):
                metrics[f"pass@{k}"] = dict(zip(task_ids, at))
        per_task[model] = metrics
        results = [final.get((t, model, i)) for t in task_ids for i in range(spec.k)]
        summaries.append(ModelSummary(
            model=model, attempts=len(results),
            completed=sum(r is not None and r.outcome == "completed" for r in results),
            failed=sum(r is not None and r.outcome == "failed" for r in results),
            infrastructure=sum(r is not None and r.outcome == "infrastructure" for r in results),
            unsettled=sum(r is None for r in results), mean_reward=stats.mean_with_interval(mean),
            pass_at=pass_at, pass_hat=pass_hat,
            cost=summarize_cost([t for t in tries if t.model == model], prices)))

    comparisons = []
    for a, b in itertools.combinations(spec.models, 2):
        for metric in per_task[a]:
            comparisons.append(stats.paired(a, b, metric, per_task[a][metric], per_task[b][metric]))
    ratings = stats.ratings(rewards) if len(spec.models) > 1 else []
    return EvalReport(spec=spec, models=summaries, comparisons=comparisons, ratings=ratings, tasks=cells,
                      cost=summarize_cost(tries, prices), prices=prices_path,
                      grading=read_versions(directory)[version - 1])


# ------------------------------------------------------------------ formatting

def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _est(e: stats.Estimate) -> str:
    if e.value is None:
        return "-"
    return f"{e.value:.3f} [{e.ci_low:.3f}, {e.ci_high:.3f}]"


def _usd(x: float | None) -> str:
    return "-" if x is None else f"${x:.4f}"


def _p(p: float | None) -> str:
    return "-" if p is None else (f"{p:.3g}" if p >= 1e-4 else "<1e-4")


def _tables(r: EvalReport) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of every table the report shows."""
    k = r.spec.k
    out = []
    rows = [[m.model, _est(m.pass_at[1]), _est(m.pass_at[k]), _est(m.pass_hat[k]), _est(m.mean_reward),
             str(m.pass_at[k].tasks), f"{m.completed}/{m.failed}/{m.infrastructure}/{m.unsettled}"] for m in r.models]
    out.append(("Models (95% bootstrap intervals over tasks)",
                ["MODEL", "PASS@1", f"PASS@{k}", f"PASS^{k}", "MEAN REWARD", "TASKS", "DONE/FAIL/INFRA/LEFT"], rows))
    if r.comparisons:
        rows = [[c.a, c.b, c.metric, _num(c.difference), f"[{_num(c.ci_low)}, {_num(c.ci_high)}]", _p(c.p_value)
                 + ("" if c.exact else " (drawn)"), f"{c.better}/{c.worse}/{c.same}"] for c in r.comparisons]
        out.append(("Paired comparisons (A - B over the same tasks; sign-flip test)",
                    ["A", "B", "METRIC", "DIFF", "95% INTERVAL", "P", "TASKS A>B/A<B/="], rows))
    if r.ratings:
        rows = [[x.policy, f"{x.rating:.1f}", f"[{x.ci_low:.0f}, {x.ci_high:.0f}]", str(x.games),
                 f"{x.wins}/{x.losses}/{x.draws}"] for x in r.ratings]
        out.append(("Bradley–Terry (attempt i against attempt i on each task; Elo scale)",
                    ["MODEL", "RATING", "95% INTERVAL", "GAMES", "W/L/D"], rows))
    rows = [[m.model, str(m.cost.tries), str(m.cost.prompt_tokens), str(m.cost.cached_tokens),
             str(m.cost.completion_tokens),
             f"{m.cost.agent_s:.1f}", _usd(m.cost.agent_usd), str(m.cost.judge_prompt_tokens
                                                                  + m.cost.judge_completion_tokens),
             _usd(m.cost.judge_usd), f"{m.cost.verify_s:.1f}", _usd(m.cost.total_usd)] for m in r.models]
    c = r.cost
    rows.append(["(all)", str(c.tries), str(c.prompt_tokens), str(c.cached_tokens), str(c.completion_tokens),
                 f"{c.agent_s:.1f}",
                 _usd(c.agent_usd), str(c.judge_prompt_tokens + c.judge_completion_tokens), _usd(c.judge_usd),
                 f"{c.verify_s:.1f}", _usd(c.total_usd)])
    out.append(("Cost (every try, infrastructure outcomes included; judge and verifier apart from the agent)",
                ["MODEL", "TRIES", "PROMPT TOK", "OF WHICH CACHED", "COMPL TOK", "AGENT S", "AGENT $", "JUDGE TOK", "JUDGE $",
                 "VERIFY S", "TOTAL $"], rows))
    rows = [[t.task_id, t.model, f"{t.successes}/{t.n}", _num(t.mean_reward), _num(t.pass_at_k),
             str(t.infrastructure), str(t.cost.prompt_tokens + t.cost.completion_tokens), f"{t.cost.wall_s:.1f}",
             _usd(t.cost.total_usd)] for t in r.tasks]
    out.append(("Tasks", ["TASK", "MODEL", "SOLVED", "MEAN REWARD", f"PASS@{k}", "INFRA", "TOKENS", "WALL S",
                          "COST"], rows))
    return out


def _notes(r: EvalReport) -> list[str]:
    notes = [f"job {r.spec.job_id}: {len(r.spec.tasks)} task(s) of {r.spec.dataset}, agent {r.spec.agent}, "
             f"k = {r.spec.k}, success = reward >= {r.spec.success_threshold:g}"]
    if r.grading is not None and r.grading.version > 1:
        g = r.grading
        notes.append(f"grading version {g.version}: {g.regraded} graded attempt(s) verified again by {g.source} "
                     f"(results stored as {g.verifier})" + (f"; {g.infrastructure} without a verdict, left out"
                                                             if g.infrastructure else ""))
    if r.cost.unpriced:
        notes.append("no price for " + ", ".join(r.cost.unpriced) + ": their money is '-' (add them to the price "
                     "table" + (f" {r.prices}" if r.prices else ", --prices FILE") + ")")
    if r.cost.sandbox_usd is None:
        notes.append("sandbox time not priced (sandbox_per_hour unset in the price table)")
    if r.cost.missing_trajectories:
        notes.append(f"{r.cost.missing_trajectories} tr(ies) without a trajectory: their tokens and seconds count 0")
    left = sum(m.unsettled for m in r.models)
    if left:
        notes.append(f"{left} attempt(s) not settled yet: `arena eval resume {r.spec.job_id}`")
    return notes


def text_lines(r: EvalReport) -> list[str]:
    from arena.table import format_table

    lines = _notes(r)
    for title, headers, rows in _tables(r):
        lines += ["", title + ":", *format_table(headers, rows, width=10_000)]
    return lines


def markdown(r: EvalReport) -> str:
    def esc(x: str) -> str:
        return x.replace("|", "\\|")

    out = [f"# Evaluation {r.spec.job_id}", "", *(f"- {n}" for n in _notes(r))]
    for title, headers, rows in _tables(r):
        out += ["", f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ HTML (inline SVG, nothing fetched)

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]


def pass_at_k_svg(r: EvalReport, width: int = 520, height: int = 300) -> str:
    """pass@k over k = 1..K per model: a line through the estimates, a band for the 95% interval."""
    left, right, top, bottom = 48, 130, 16, 36
    w, h = width - left - right, height - top - bottom
    ks = list(range(1, r.spec.k + 1))

    def x(k: int) -> float:
        return left + (w * (k - 1) / (len(ks) - 1) if len(ks) > 1 else w / 2)

    def y(v: float) -> float:
        return top + h * (1 - v)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="pass@k over k">']
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="11">{v:g}</text>')
    for k in ks:
        parts.append(f'<text x="{x(k):.1f}" y="{top + h + 16}" text-anchor="middle" font-size="11">{k}</text>')
    parts.append(f'<text x="{left + w / 2}" y="{height - 4}" text-anchor="middle" font-size="12">k</text>')
    for i, m in enumerate(r.models):
        color = COLORS[i % len(COLORS)]
        pts = [(k, m.pass_at[k]) for k in ks if m.pass_at[k].value is not None]
        if not pts:
            continue
        band = [f"{x(k):.1f},{y(e.ci_high):.1f}" for k, e in pts] + [f"{x(k):.1f},{y(e.ci_low):.1f}"
                                                                    for k, e in reversed(pts)]
        parts.append(f'<polygon points="{" ".join(band)}" fill="{color}" fill-opacity="0.15" stroke="none"/>')
        line = " ".join(f"{x(k):.1f},{y(e.value):.1f}" for k, e in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        for k, e in pts:
            parts.append(f'<circle cx="{x(k):.1f}" cy="{y(e.value):.1f}" r="3" fill="{color}">'
                         f'<title>{html.escape(m.model)} pass@{k} = {_est(e)}</title></circle>')
        parts.append(f'<rect x="{left + w + 12}" y="{top + 18 * i}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{left + w + 26}" y="{top + 18 * i + 9}" font-size="11">{html.escape(m.model)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def heat_map_svg(r: EvalReport, cell: int = 22) -> str:
    """Models × tasks, each cell the task's solved share for the model (white 0 to green 1; grey: no verdict)."""
    label_w = max(80, 7 * max(len(m) for m in r.spec.models))
    task_ids = [t.task_id for t in r.spec.tasks]
    head = min(160, 7 * max(len(t) for t in task_ids))
    width, height = label_w + cell * len(task_ids) + 8, head + cell * len(r.spec.models) + 8
    by = {(c.model, c.task_id): c for c in r.tasks}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="solved share per task and model">']
    for j, t in enumerate(task_ids):
        cx = label_w + cell * j + cell / 2
        parts.append(f'<text transform="translate({cx:.1f},{head - 4}) rotate(-60)" font-size="10">'
                     f'{html.escape(t[:24])}</text>')
    for i, model in enumerate(r.spec.models):
        yy = head + cell * i
        parts.append(f'<text x="{label_w - 6}" y="{yy + cell * 0.7:.1f}" text-anchor="end" font-size="11">'
                     f'{html.escape(model)}</text>')
        for j, t in enumerate(task_ids):
            c = by[(model, t)]
            if c.n:
                share = c.successes / c.n
                fill = f"rgb({int(255 - 200 * share)},{int(255 - 80 * share)},{int(255 - 200 * share)})"
            else:
                fill = "#bbb"
            tip = f"{model} on {t}: {c.successes}/{c.n} solved, {c.infrastructure} infrastructure"
            parts.append(f'<rect x="{label_w + cell * j}" y="{yy}" width="{cell - 2}" height="{cell - 2}" '
                         f'fill="{fill}" stroke="#999" stroke-width="0.5"><title>{html.escape(tip)}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def html_page(r: EvalReport) -> str:
    """One file, no script, no stylesheet or font fetched: tables, the pass@k curve, the heat map."""
    body = [f"<h1>Evaluation {html.escape(r.spec.job_id)}</h1>", "<ul>",
            *(f"<li>{html.escape(n)}</li>" for n in _notes(r)), "</ul>",
            f"<h2>pass@k over k</h2>{pass_at_k_svg(r)}", f"<h2>Solved share, models × tasks</h2>{heat_map_svg(r)}"]
    for title, headers, rows in _tables(r):
        body.append(f"<h2>{html.escape(title)}</h2><table><thead><tr>"
                    + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr></thead><tbody>"
                    + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
                    + "</tbody></table>")
    style = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;"
             "margin-bottom:1em}th,td{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}"
             "th{background:#f4f4f4}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Evaluation '
            f'{html.escape(r.spec.job_id)}</title><style>{style}</style></head><body>{"".join(body)}</body></html>\n')


def write_files(r: EvalReport, out: Path) -> list[Path]:
    """``report.md``, ``report.json`` and ``report.html`` in ``out`` (``report.vN.*`` for grading version N > 1)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = report_stem(r.grading.version if r.grading is not None else 1)
    paths = [out / f"{stem}.md", out / f"{stem}.json", out / f"{stem}.html"]
    paths[0].write_text(markdown(r))
    paths[1].write_bytes(msgspec.json.format(msgspec.json.encode(r), indent=2) + b"\n")
    paths[2].write_text(html_page(r))
    return paths
