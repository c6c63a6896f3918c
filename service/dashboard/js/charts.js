// Charts on uPlot (vendored): step series with optional bands, bar histograms, categorical lines,
// and an HTML heatmap. Each chart element carries data-points (x values drawn) for tests and tools.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { fmt, h } from "./dom.js";

export const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#db2777"];
const HEIGHT = 220;
const REFETCH_AFTER = 3000; // points per series; the server buckets whole jobs to 1000

function frame(title, note) {
  const plot = h("div", { class: "plot" });
  const el = h("div", { class: "chart", "data-title": title, "data-points": "0" },
    h("h3", {}, title), plot, note ? h("div", { class: "legend-note" }, note) : null);
  return { el, plot };
}

const Y_AXIS = { size: 60, values: (u, vs) => vs.map((v) => fmt(v, 3)) };

/** A uPlot over steps (not time) in `plot`, as wide as the chart element and following its resizes. */
function draw(el, plot, opts, data) {
  const height = opts.height || HEIGHT;
  const width = () => Math.max(280, el.clientWidth - 16);
  const u = new uPlot({ scales: { x: { time: false } }, ...opts, width: width(), height }, data, plot);
  u.observer = new ResizeObserver(() => u.setSize({ width: width(), height }));
  u.observer.observe(el);
  return u;
}

/** Lines over training steps. `keys` are metric names; `band` draws mean ± std of one key.
 *  load() takes the API's series (downsampled buckets draw their min..max as a faint band);
 *  append() adds one live step. onZoom(min, max) fires on drag-select, (null, null) on double-click. */
export class StepChart {
  constructor({ title, keys, band, onZoom, note }) {
    Object.assign(this, { title, keys, band, onZoom });
    this.data = new Map(); // key -> {x:[], y:[], lo:[], hi:[], ranged}
    ({ el: this.el, plot: this.plot } = frame(title, note));
    this.el.__chart = this; // for tests and the browser console
    this.el.addEventListener("dblclick", () => this.onZoom?.(null, null));
  }

  load(seriesByKey, { keepScale = false } = {}) {
    for (const key of this.keys) {
      const s = seriesByKey[key];
      if (!s) continue;
      const d = { x: [], y: [], lo: [], hi: [], ranged: !!s.downsampled };
      for (const p of s.points) { d.x.push(p.step); d.y.push(p.value); d.lo.push(p.min); d.hi.push(p.max); }
      this.data.set(key, d);
    }
    this.render(keepScale);
  }

  append(step, values) {
    let changed = false;
    for (const key of this.keys) {
      if (!(key in values)) continue;
      const d = this.data.get(key) || { x: [], y: [], lo: [], hi: [], ranged: false };
      const v = values[key];
      if (d.x.length && step <= d.x[d.x.length - 1]) continue; // already have it
      d.x.push(step); d.y.push(v); d.lo.push(v); d.hi.push(v);
      this.data.set(key, d);
      changed = true;
    }
    if (!changed) return;
    // A long live session would grow past what the server sends for a whole job: refetch it bucketed.
    if (this.onZoom && Math.max(...[...this.data.values()].map((d) => d.x.length)) > REFETCH_AFTER) this.onZoom(null, null);
    else this.render(true);
  }

  get present() { return this.keys.filter((k) => this.data.get(k)?.x.length); }

  render(keepScale) {
    const keys = this.present;
    if (!keys.length) {
      if (!this.u) this.plot.replaceChildren(h("div", { class: "empty" }, "no data yet"));
      return;
    }
    const tables = keys.map((k) => { const d = this.data.get(k); return [d.x, d.y]; });
    const extra = []; // band edges: [label, lo array aligned later, hi array]
    if (this.band && this.data.get(this.band.key) && this.data.get(this.band.std)) {
      const m = this.data.get(this.band.key), sd = this.data.get(this.band.std);
      const std = new Map(sd.x.map((x, i) => [x, sd.y[i]]));
      const lo = [], hi = [];
      m.x.forEach((x, i) => { const s = std.get(x) ?? 0; lo.push(m.y[i] - s); hi.push(m.y[i] + s); });
      extra.push({ label: `${this.band.key} ± std`, of: keys.indexOf(this.band.key), lo, hi, x: m.x });
    }
    for (const k of keys) {
      const d = this.data.get(k);
      if (d.ranged && !(this.band && k === this.band.key)) {
        extra.push({ label: `${k} min..max`, of: keys.indexOf(k), lo: d.lo, hi: d.hi, x: d.x });
      }
    }
    for (const e of extra) tables.push([e.x, e.hi], [e.x, e.lo]);
    const data = tables.length > 1 ? uPlot.join(tables) : [tables[0][0], tables[0][1]];
    const series = [{ label: "step" }, ...keys.map((k, i) => ({
      label: k, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
      points: { show: (u) => u.data[0].length < 60 }, value: (u, v) => fmt(v, 4),
    }))];
    const bands = [];
    for (const e of extra) {
      const color = COLORS[e.of % COLORS.length];
      series.push({ label: `${e.label} hi`, stroke: "transparent", spanGaps: true, legend: false, points: { show: false } },
                  { label: `${e.label} lo`, stroke: "transparent", spanGaps: true, legend: false, points: { show: false } });
      bands.push({ series: [series.length - 2, series.length - 1], fill: color + "22" });
    }
    this.el.dataset.points = String(data[0].length);
    this.el.dataset.series = keys.join(",");
    const sig = series.map((s) => s.label).join("|");
    if (this.u && this.sig === sig) {
      this.u.setData(data, !keepScale);
      return;
    }
    this.u?.observer.disconnect(); // the chart is rebuilt when its set of series changes
    this.u?.destroy();
    this.plot.replaceChildren();
    this.sig = sig;
    this.u = draw(this.el, this.plot, {
      series, bands, legend: { live: true }, axes: [{}, Y_AXIS],
      cursor: { drag: { x: true, y: false, setScale: true } },
      hooks: { setSelect: [(u) => {
        if (u.select.width > 2 && this.onZoom) {
          this.onZoom(Math.floor(u.posToVal(u.select.left, "x")), Math.ceil(u.posToVal(u.select.left + u.select.width, "x")));
        }
      }] },
    }, data);
  }
}

/** One overlaid metric from several jobs: `tables` = [{label, x:[], y:[]}]. */
export function overlayChart(title, tables) {
  const { el, plot } = frame(title);
  const present = tables.filter((t) => t.x.length);
  if (!present.length) { plot.append(h("div", { class: "empty" }, "no data for this metric")); return el; }
  const data = present.length > 1 ? uPlot.join(present.map((t) => [t.x, t.y])) : [present[0].x, present[0].y];
  el.dataset.points = String(data[0].length);
  el.dataset.series = present.map((t) => t.label).join(",");
  queueMicrotask(() => draw(el, plot, {
    height: HEIGHT + 120,
    series: [{ label: "step" }, ...present.map((t, i) => ({ label: t.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true }))],
    axes: [{}, Y_AXIS],
  }, data));
  return el;
}

/** Bars: counts over bins given by their edges (e.g. an influence histogram). */
export function histogramChart(title, edges, counts, note) {
  const { el, plot } = frame(title, note);
  const centers = counts.map((_, i) => (edges[i] + edges[i + 1]) / 2);
  el.dataset.points = String(counts.length);
  queueMicrotask(() => draw(el, plot, {
    series: [{ label: "score", value: (u, v) => fmt(v, 4) },
             { label: "samples", stroke: COLORS[0], fill: COLORS[0] + "66", paths: uPlot.paths.bars({ size: [0.9] }), points: { show: false } }],
    axes: [{ values: (u, vs) => vs.map((v) => fmt(v, 2)) }, { size: 40 }],
  }, [centers, counts]));
  return el;
}

/** Lines over a categorical x (e.g. sparsity thresholds): labels[i] names x = i. */
export function categoryChart(title, labels, lines, note) {
  const { el, plot } = frame(title, note);
  const x = labels.map((_, i) => i);
  el.dataset.points = String(labels.length);
  queueMicrotask(() => draw(el, plot, {
    series: [{ label: "threshold", value: (u, v) => labels[v] ?? "" },
             ...lines.map((l, i) => ({ label: l.label, stroke: COLORS[i % COLORS.length], width: 1.5, value: (u, v) => fmt(v, 4) }))],
    axes: [{ splits: () => x, values: (u, vs) => vs.map((v) => labels[v] ?? "") }, Y_AXIS],
  }, [x, ...lines.map((l) => l.y)]));
  return el;
}

/** rows x columns of values in [0, 1], coloured from white (0) to blue (1). */
export function heatmap(title, rowLabel, grid, note) {
  const rows = Object.keys(grid);
  const cols = [...new Set(rows.flatMap((r) => Object.keys(grid[r])))].sort();
  const cell = (v) => {
    if (v === undefined) return h("td", { class: "muted" }, "–");
    const a = Math.max(0, Math.min(1, v));
    return h("td", { style: { background: `rgba(37, 99, 235, ${a.toFixed(3)})`, color: a > 0.6 ? "#fff" : "#111" },
                     title: `${v}` }, fmt(v, 3));
  };
  return h("div", { class: "chart", "data-title": title, "data-points": String(rows.length * cols.length) },
    h("h3", {}, title),
    h("div", { style: { overflow: "auto" } },
      h("table", { class: "heatmap" },
        h("thead", {}, h("tr", {}, h("th", {}, rowLabel), cols.map((c) => h("th", {}, c)))),
        h("tbody", {}, rows.map((r) => h("tr", {}, h("th", {}, r), cols.map((c) => cell(grid[r][c]))))))),
    note ? h("div", { class: "legend-note" }, note) : null);
}

/** Points (x, y) with the line y = x for reference: e.g. a predicted change against the actual one. */
export function scatterChart(title, points, { xLabel, yLabel, note } = {}) {
  const { el, plot } = frame(title, note);
  el.dataset.points = String(points.length);
  if (!points.length) { plot.append(h("div", { class: "empty" }, "no data yet")); return el; }
  const sorted = [...points].sort((a, b) => a.x - b.x); // uPlot wants x ascending
  const xs = sorted.map((p) => p.x);
  const min = Math.min(xs[0], ...sorted.map((p) => p.y)), max = Math.max(xs.at(-1), ...sorted.map((p) => p.y));
  const pad = (max - min) * 0.08 || Math.abs(max) * 0.1 || 1; // keep the outermost points off the frame
  const lo = min - pad, hi = max + pad;
  queueMicrotask(() => draw(el, plot, {
    scales: { x: { time: false, range: [lo, hi] }, y: { range: [lo, hi] } },
    series: [{ label: xLabel, value: (u, v) => fmt(v, 4) },
             { label: yLabel, stroke: COLORS[0], paths: () => null, points: { show: true, size: 7, fill: COLORS[0] },
               value: (u, v) => fmt(v, 4) },
             { label: "y = x", stroke: "#9ca3af", dash: [4, 4], width: 1, points: { show: false }, spanGaps: true }],
    axes: [{ label: xLabel, values: (u, vs) => vs.map((v) => fmt(v, 3)) }, { ...Y_AXIS, label: yLabel }],
  }, [[lo, ...xs, hi], [null, ...sorted.map((p) => p.y), null], [lo, ...xs.map(() => null), hi]]));
  return el;
}
