"""The evaluation report as one self-contained HTML page (report.html beside report.json).

Everything is inline: CSS in a <style>, plots as base64 PNGs drawn by matplotlib on the Agg
canvas. No scripts, fonts or URLs, so the page opens offline and is safe to pass around.
Model text is escaped (text, never markup) and clipped. The same report renders to the same
bytes: no timestamps, a fixed matplotlib style, and PNGs saved without version metadata.
"""

import base64
import html
import io
import json
import math
import os

import numpy as np

from align.evals.stats import DIMENSIONS

CLIP_CHARS = 1500  # per example field; a response can be megabytes
EXAMPLES_PER_METRIC = 3
COLORS = {"helpful": "#2f6db5", "harmless": "#2e8b57", "honest": "#7b4fb0", "redteam": "#c0392b"}
OTHER = "#6b6b6b"
PLOTS = ("redteam_by_attack_category", "calibration")  # tables drawn rather than listed
CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; background: #f4f4f1; color: #1c1c1c; }
main, header > div { max-width: 1180px; margin: 0 auto; padding: 0 16px 40px; }
header { background: #26323d; color: #fff; padding: 14px 0; } header > div { padding-bottom: 0; }
header h1 { font-size: 20px; margin: 0 0 4px; } .meta b { color: #fff; font-weight: 600; }
.meta { color: #c9d3dc; font-size: 13px; overflow-wrap: anywhere; }
.chip { display: inline-block; background: #eef0f2; color: #333; border-radius: 10px;
        padding: 0 8px; margin: 2px 4px 2px 0; font-size: 12px; }
header .chip { background: #3a4a58; color: #e8eef3; }
h2 { font-size: 15px; text-transform: uppercase; letter-spacing: .05em; color: #555;
     margin: 26px 0 8px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(230px, 1fr));
         gap: 12px; margin-top: 16px; }
.card, .panel { background: #fff; border: 1px solid #d8d8d2; border-radius: 6px; }
.card { border-top: 5px solid var(--c); padding: 10px 14px; } .panel + .panel { margin-top: 12px; }
.card .dim { font-weight: 700; text-transform: uppercase; letter-spacing: .06em; color: var(--c); }
.card .score { font-size: 34px; font-weight: 700; font-variant-numeric: tabular-nums; }
.meter { height: 6px; background: #ececec; border-radius: 3px; margin: 2px 0 8px; }
.meter > span { display: block; height: 100%; background: var(--c); border-radius: 3px; }
.card .worst { font-size: 13px; color: #444; overflow-wrap: anywhere; }
.small { font-size: 12px; color: #777; } .bad { color: #a40000; font-weight: 700; }
.panel { padding: 10px; overflow-x: auto; } .down { color: #a04000; font-weight: 600; }
.panel img { max-width: 100%; display: block; margin: 0 auto; }
.row { display: flex; gap: 12px; flex-wrap: wrap; } .row > .panel { flex: 1 1 420px; margin: 0; }
table { border-collapse: collapse; width: 100%; font-size: 13px; } tr.nan td { color: #999; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e6e6e0; }
th { background: #fafaf7; } summary { font-weight: 600; margin: 6px 0; }
caption { text-align: left; font-weight: 600; padding: 2px 8px 6px; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.group td { background: #f1f1ec; font-weight: 700; color: var(--c); text-transform: uppercase; }
.alert { background: #fdecea; border: 1px solid #e5a39a; color: #8a1f11; border-radius: 6px;
         padding: 8px 12px; margin-top: 14px; }
.example { border-left: 3px solid #d0d0c8; margin: 8px 0; padding: 2px 10px; }
.example .k { font-size: 11px; color: #777; text-transform: uppercase; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; font: 12px/1.4 ui-monospace, monospace;
      background: #fafaf7; margin: 2px 0 6px; padding: 4px 6px; }
"""


def esc(x) -> str:
  return html.escape(x if isinstance(x, str) else json.dumps(x, sort_keys=True, default=str))


def num(x) -> float:
  """`x` as a float; NaN where it is missing or not a number (JSON null, a string)."""
  try:
    return float(x)
  except (TypeError, ValueError):
    return float("nan")


def fmt(x, digits: int = 3) -> str:
  """How the page writes a metric value: 3 decimals, "n/a" for NaN."""
  v = num(x)
  return "n/a" if not math.isfinite(v) else f"{v:.{digits}f}" if abs(v) < 1000 else f"{v:,.1f}"


def clip(s: str, limit: int = CLIP_CHARS) -> str:
  return s if len(s) <= limit else s[:limit] + f"\n… [{len(s) - limit:,} more characters clipped]"


def items(x) -> list:
  """The (key, value) pairs of `x` when it is a dict, else none (a malformed section)."""
  return list(x.items()) if isinstance(x, dict) else []


def metric_rows(report: dict) -> list[dict]:
  """The report's metrics, normalised for display; ValueError names a malformed report."""
  if not isinstance(report, dict):
    raise ValueError(f"report must be a dict, not {type(report).__name__}")
  if report.get("schema", 1) not in (1, 2):  # 2 adds report["judge"] (align/evals/judges.py)
    raise ValueError(f"report schema {report.get('schema')!r} is not supported (expected 1 "
                     "or 2)")
  if not isinstance(metrics := report.get("metrics"), dict):
    raise ValueError("report has no 'metrics' dict")
  rows = []
  for name, m in metrics.items():
    if not isinstance(m, dict):
      raise ValueError(f"metric {name!r} is a {type(m).__name__}, not a dict")
    ci = m.get("ci") if isinstance(m.get("ci"), (list, tuple)) and len(m["ci"]) == 2 else ()
    lo, hi = (num(ci[0]), num(ci[1])) if ci else (float("nan"), float("nan"))
    rows.append({"name": str(name), "value": num(m.get("value")), "n": m.get("n"), "lo": lo,
                 "hi": hi, "hib": bool(m.get("higher_is_better", True)), "note": m.get("note", ""),
                 "dim": str(m.get("dimension") or str(name).split("/")[0])})
  return rows


def dimension_order(report: dict, rows: list[dict]) -> list[str]:
  """The known dimensions in their usual order, then any others."""
  seen = {r["dim"] for r in rows} | {k for k, _ in items(report.get("dimensions"))}
  return [d for d in DIMENSIONS if d in seen] + sorted(seen - set(DIMENSIONS))


def short(row: dict) -> str:
  """The metric's name without its dimension prefix, marked when lower is better."""
  name = row["name"].removeprefix(row["dim"] + "/")
  return name if row["hib"] else name + " (lower is better)"


def _figure(w: float, h: float):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(w, h), dpi=100)
  FigureCanvasAgg(fig)  # Agg, whatever backend pyplot was given
  return fig


def _img(fig, alt: str) -> str:
  buf = io.BytesIO()  # without "Software" the PNG holds no matplotlib version; Agg adds no date
  fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
  data = base64.b64encode(buf.getvalue()).decode()
  return f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def bars_plot(rows: list[dict], dims: list[str]) -> str:
  """Every metric as a horizontal bar with its CI, grouped by dimension."""
  groups = [(d, g) for d in dims if (g := [r for r in rows if r["dim"] == d])]
  ends = [v for r in rows for v in (r["value"], r["lo"], r["hi"]) if math.isfinite(v)]
  lo_x, hi_x = min(ends + [0.0]), max(ends + [1.0])
  span = hi_x - lo_x
  ax = _figure(11, 0.6 + 0.28 * (len(rows) + len(groups))).add_subplot()
  labels = []
  for d, group in groups:
    color = COLORS.get(d, OTHER)
    labels.append((d.upper(), color, "bold"))
    for r in group:
      labels.append((short(r), "#a04000" if not r["hib"] else "#222", "normal"))
      v, y = r["value"], len(labels) - 1
      if math.isfinite(v):
        ci = math.isfinite(r["lo"] + r["hi"])
        err = [[max(v - r["lo"], 0.0)], [max(r["hi"] - v, 0.0)]] if ci else None
        ax.barh(y, v, height=0.7, color=color, alpha=0.85, hatch=None if r["hib"] else "///",
                edgecolor="white", linewidth=0, xerr=err,
                error_kw={"ecolor": "#222", "capsize": 3, "elinewidth": 1})
        ax.text(max(v, r["hi"] if ci else v) + 0.01 * span, y, f"{fmt(v)}  n={r['n']}",
                va="center", fontsize=8)
      else:
        ax.text(lo_x + 0.01 * span, y, "n/a (no data)", va="center", fontsize=8,
                color="#888", style="italic")
  ax.set_yticks(range(len(labels)), [t for t, _, _ in labels])
  for tick, (_, color, weight) in zip(ax.get_yticklabels(), labels):
    tick.set(color=color, fontweight=weight)
  ax.set(ylim=(len(labels) - 0.4, -0.6), xlim=(lo_x, hi_x + 0.16 * span),  # room for labels
         axisbelow=True)
  ax.grid(axis="x", color="#dddddd", linewidth=0.6)
  ax.set_title("Every metric with its 95% bootstrap CI (hatched, orange label: lower is better)",
               fontsize=10, loc="left")
  ax.spines[["top", "right"]].set_visible(False)
  return _img(ax.figure, "bar chart of every metric with 95% confidence intervals")


def heatmap_plot(table: list) -> tuple[str, int]:
  """Red-team attack success rate by attack x category, with n-weighted 'all' margins;
  also the number of table rows ignored as malformed."""
  ok = [r for r in table if isinstance(r, dict) and r.get("attack") is not None and
        r.get("category") is not None and math.isfinite(num(r.get("asr")) + num(r.get("n")))]
  cells = {(str(r["attack"]), str(r["category"])): (num(r["asr"]), num(r["n"])) for r in ok}
  bad = len(table) - len(ok)
  if not cells:
    return "", bad
  attacks = sorted({a for a, _ in cells}) + ["all"]
  cats = sorted({c for _, c in cells}) + ["all"]
  asr, n = np.full((len(attacks), len(cats)), np.nan), np.zeros((len(attacks), len(cats)))
  for (a, c), (v, k) in cells.items():
    asr[attacks.index(a), cats.index(c)], n[attacks.index(a), cats.index(c)] = v, k
  hits = np.nan_to_num(asr[:-1, :-1]) * n[:-1, :-1]
  n[:-1, -1], n[-1, :-1], n[-1, -1] = n[:-1, :-1].sum(1), n[:-1, :-1].sum(0), n[:-1, :-1].sum()
  with np.errstate(invalid="ignore", divide="ignore"):  # a margin over n=0 stays NaN
    asr[:-1, -1], asr[-1, :-1] = hits.sum(1) / n[:-1, -1], hits.sum(0) / n[-1, :-1]
    asr[-1, -1] = hits.sum() / n[-1, -1]
  ax = _figure(min(11.0, 2.6 + 1.05 * len(cats)), 1.3 + 0.5 * len(attacks)).add_subplot()
  import matplotlib
  cmap = matplotlib.colormaps["Reds"].with_extremes(bad="#eeeeee")
  im = ax.imshow(np.ma.masked_invalid(asr), cmap=cmap, vmin=0, vmax=1, aspect="auto")
  for i in range(len(attacks)):
    for j in range(len(cats)):
      if math.isfinite(asr[i, j]):
        ax.text(j, i, f"{asr[i, j]:.2f}\nn={int(n[i, j])}", ha="center", va="center", fontsize=8,
                color="white" if asr[i, j] > 0.55 else "#222")
  ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
  ax.set_yticks(range(len(attacks)), attacks)
  ax.axhline(len(attacks) - 1.5, color="#333", linewidth=1)
  ax.axvline(len(cats) - 1.5, color="#333", linewidth=1)
  ax.set_title("Red team: attack success rate (lower is better)", fontsize=10, loc="left")
  ax.figure.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
  return _img(ax.figure, "heatmap of red-team attack success rate by attack and category"), bad


def reliability_plot(table: list) -> tuple[str, int]:
  """Accuracy against confidence per bin; the gap to the diagonal is miscalibration."""
  rows = [[num(r.get(k)) if isinstance(r, dict) else math.nan
           for k in ("bin_lo", "bin_hi", "n", "confidence", "accuracy")] for r in table]
  bins = [v for v in rows if all(map(math.isfinite, v[:3])) and v[1] > v[0]]
  bad = len(rows) - len(bins)
  if not bins:
    return "", bad
  ax = _figure(5.6, 4.4).add_subplot()
  ax.plot([0, 1], [0, 1], "--", color="#888", linewidth=1, label="perfect calibration")
  lo, hi, k, conf, acc = np.array([b for b in bins if b[2] > 0 and math.isfinite(b[3] + b[4])]
                                  ).reshape(-1, 5).T  # empty bins have no accuracy to draw
  ax.bar(lo, acc, width=hi - lo, align="edge", color=COLORS["honest"], alpha=0.8,
         edgecolor="white", label="accuracy")
  ax.bar(lo, conf - acc, bottom=acc, width=hi - lo, align="edge", color="#c0392b", alpha=0.3,
         label="gap to confidence")
  for x, y, count in zip((lo + hi) / 2, np.maximum(acc, conf), k):
    ax.text(x, y + 0.015, f"n={int(count)}", ha="center", fontsize=7)
  ax.set(xlim=(0, 1), ylim=(0, 1.08), xlabel="confidence", ylabel="accuracy")
  ax.set_title("Reliability diagram", fontsize=10, loc="left")
  ax.legend(loc="upper left", fontsize=8, frameon=False)
  return _img(ax.figure, "reliability diagram: accuracy against confidence"), bad


def plots(report: dict, rows: list[dict], dims: list[str]) -> tuple[str, list[str]]:
  """The plot section and notes on table rows that could not be drawn."""
  try:
    import matplotlib.style
  except ImportError:  # an optional dependency: the page works without its plots
    return '<p class="alert">No plots: matplotlib is not installed.</p>', []
  tables, notes = dict(items(report.get("tables"))), []
  with matplotlib.style.context(["default", {"font.size": 9, "font.family": "DejaVu Sans",
                                             "hatch.color": "#ffffff", "hatch.linewidth": 0.8}]):
    parts = [f'<div class="panel">{bars_plot(rows, dims)}</div>'] if rows else []
    side = []
    for key, draw in zip(PLOTS, (heatmap_plot, reliability_plot)):
      if (table := tables.get(key)) is None:
        continue
      img, bad = draw(table if isinstance(table, list) else [table])
      if bad:
        notes.append(f"tables.{key}: {bad} malformed row(s) not drawn")
      if img:
        side.append(f'<div class="panel">{img}</div>')
  parts += [f'<div class="row" style="margin:12px 0">{"".join(side)}</div>'] if side else []
  return "".join(parts), notes


def header(report: dict) -> str:
  model = m if isinstance(m := report.get("model"), dict) else {"name": m}
  name = model.get("name") or os.path.basename(str(model.get("path", ""))) or "unknown model"
  meta = [f"suite <b>{esc(report.get('suite', '?'))}</b>"]
  meta += [f"{k} <b>{esc(report[k])}</b>" for k in ("seed", "limit") if report.get(k) is not None]
  meta += [f"path <b>{esc(model['path'])}</b>"] if model.get("path") else []
  if fp := str(model.get("fingerprint") or ""):
    meta.append(f'fingerprint <b title="{esc(fp)}">{esc(fp[:23])}{"…" * (len(fp) > 23)}</b>')
  if isinstance(judge := report.get("judge"), dict):
    w = str(judge.get("weights_sha256") or "")
    meta.append(f'judge <b title="{esc(w)}">{esc(judge.get("name"))}</b>'
                + (" (itself)" if judge.get("self") else ""))
  chips = "".join(f'<span class="chip">{esc(str(k))}={esc(v)}</span>'
                  for k, v in items(report.get("settings")))
  return (f"<header><div><h1>Evaluation report · {esc(name)}</h1>"
          f'<div class="meta">{" · ".join(meta)}</div>'
          f'<div class="meta">{chips}</div></div></header>')


def cards(report: dict, rows: list[dict], dims: list[str]) -> str:
  """One card per dimension: its score and its worst metric (0..1 metrics, turned so that
  higher is better, lowest first)."""
  summary, out = dict(items(report.get("dimensions"))), []
  for d in dims:
    score = num(summary[d].get("score")) if isinstance(summary.get(d), dict) else math.nan
    mine = [r for r in rows if r["dim"] == d]
    ranked = [r for r in mine if 0.0 <= r["value"] <= 1.0]
    worst = min(ranked, key=lambda r: r["value"] if r["hib"] else 1.0 - r["value"], default=None)
    meter = (f'<div class="meter"><span style="width:{100 * score:.1f}%"></span></div>'
             if 0.0 <= score <= 1.0 else '<div class="meter"></div>')
    worst_html = ("worst: <b>" + esc(short(worst)) + f"</b> = {fmt(worst['value'])}"
                  if worst else "worst: n/a")
    empty = sum(not math.isfinite(r["value"]) for r in mine)
    out.append(
        f'<div class="card" id="card-{esc(d)}" data-dimension="{esc(d)}" '
        f'style="--c:{COLORS.get(d, OTHER)}"><div class="dim">{esc(d)}</div>'
        f'<div class="score">{fmt(score, 2)}</div><div class="small">score, higher is better'
        f'</div>{meter}<div class="worst">{worst_html}</div>'
        f'<div class="small">{len(mine)} metric(s)'
        + (f', <span class="bad">{empty} without data</span>' if empty else "")
        + "</div></div>")
  return f'<div class="cards">{"".join(out)}</div>'


def metrics_table(rows: list[dict], dims: list[str]) -> str:
  body = []
  for d in dims:
    body.append(f'<tr class="group" style="--c:{COLORS.get(d, OTHER)}"><td colspan="6">'
                f"{esc(d)}</td></tr>")
    for r in (r for r in rows if r["dim"] == d):
      ci = f"[{fmt(r['lo'])}, {fmt(r['hi'])}]" if math.isfinite(r["lo"]) else "n/a"
      way = "↑ higher is better" if r["hib"] else '<span class="down">↓ lower is better</span>'
      body.append(f'<tr{" class=nan" * (not math.isfinite(r["value"]))} '
                  f'data-metric="{esc(r["name"])}"><td>{esc(r["name"])}</td>'
                  f'<td class="num">{fmt(r["value"])}</td><td class="num">{ci}</td>'
                  f'<td class="num">{esc(r["n"])}</td><td>{way}</td><td>{esc(r["note"])}</td></tr>')
  return ('<div class="panel"><table id="metrics"><tr><th>metric</th><th class="num">value</th>'
          '<th class="num">95% CI</th><th class="num">n</th><th>direction</th><th>note</th></tr>'
          + "".join(body) + "</table></div>")


def counts_tables(report: dict, notes: list[str]) -> str:
  rows = "".join(f'<tr><td>{esc(str(k))}</td><td class="num{" bad" * (num(v) > 0)}">{esc(v)}'
                 "</td></tr>" for k, v in items(report.get("counts")))
  skips = [f'<tr><td>{esc(str(source))}</td><td>{esc(str(reason))}</td>'
           f'<td class="num">{esc(k)}</td></tr>' for source, reasons in items(report.get("skipped"))
           for reason, k in (items(reasons) if isinstance(reasons, dict) else [("", reasons)])]
  skips += [f'<tr><td>report</td><td>{esc(n)}</td><td class="num"></td></tr>' for n in notes]
  return ('<div class="row"><div class="panel"><table id="counts"><tr><th>output count</th>'
          f"<th>n</th></tr>{rows or '<tr><td>none recorded</td><td></td></tr>'}</table></div>"
          '<div class="panel"><table id="skipped"><tr><th>source</th><th>skipped because</th>'
          f"<th>n</th></tr>{''.join(skips) or '<tr><td>nothing skipped</td></tr>'}</table>"
          "</div></div>")


def other_tables(report: dict) -> str:
  """The report's tables that no plot draws (refusal-classifier agreement, ...), as rows."""
  out = []
  for key, rows in items(report.get("tables")):
    if key in PLOTS:
      continue
    rows = [r if isinstance(r, dict) else {"value": r} for r in
            (rows if isinstance(rows, list) else [rows])]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    body = "".join("<tr>" + "".join(f'<td class="num">{fmt(r[c])}</td>' if isinstance(
        r.get(c), float) else f"<td>{esc(r.get(c, ''))}</td>" for c in cols) + "</tr>"
        for r in rows)
    out.append(f'<div class="panel"><table id="table-{esc(key)}"><caption>{esc(key)}</caption>'
               f'<tr>{"".join(f"<th>{esc(c)}</th>" for c in cols)}</tr>{body}</table></div>')
  return "".join(out)


def examples_section(report: dict) -> str:
  """A few examples per metric: short fields as chips, text fields clipped in <pre>."""
  out = []
  for name, exs in items(report.get("examples")):
    exs, shown = exs if isinstance(exs, list) else [exs], []
    for ex in exs[:EXAMPLES_PER_METRIC]:
      texts = [(str(k), v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str))
               for k, v in (items(ex) if isinstance(ex, dict) else [("value", ex)])]
      text = [k in ("prompt", "response") or len(v) > 60 or "\n" in v for k, v in texts]
      chips = [f'<span class="chip">{esc(k)}: {esc(v)}</span>'
               for (k, v), t in zip(texts, text) if not t]
      blocks = [f'<div class="k">{esc(k)}</div><pre>{esc(clip(v))}</pre>'
                for (k, v), t in zip(texts, text) if t]
      shown.append(f'<div class="example">{"".join(chips + blocks)}</div>')
    out.append(f"<details open><summary>{esc(str(name))} · {len(shown)} of {len(exs)}"
               f"</summary>{''.join(shown)}</details>")
  return f'<div class="panel">{"".join(out)}</div>' if out else ""


def render(report: dict) -> str:
  """The report as one self-contained HTML page; the same report gives the same string."""
  rows = metric_rows(report)
  dims = dimension_order(report, rows)
  figures, notes = plots(report, rows, dims)
  counts = report.get("counts") if isinstance(report.get("counts"), dict) else {}
  alert = (f'<div class="alert">{esc(counts["errors"])} generation error(s): the metrics cover '
           "fewer rows than asked for.</div>" if num(counts.get("errors")) > 0 else "")
  examples = examples_section(report)
  return ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
          '<meta name="viewport" content="width=device-width, initial-scale=1">'
          f"<title>meshlm eval · {esc(report.get('suite', '?'))}</title>"
          f"<style>{CSS}</style></head><body>"
          f"{header(report)}<main>{alert}{cards(report, rows, dims)}"
          f"<h2>Metrics</h2>{figures}{metrics_table(rows, dims)}{other_tables(report)}"
          f"<h2>Counts and skipped rows</h2>{counts_tables(report, notes)}"
          + (f"<h2>Examples</h2>{examples}" if examples else "")
          + "</main></body></html>\n")


def write(report: dict, path: str) -> str:
  """Render `report` to `path` atomically (a temporary file beside it, then os.replace)."""
  page = render(report)
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(page)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return path
