// A tiny DOM builder: text always goes in as text (completions are model output, never HTML).

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export const clear = (el) => { while (el.firstChild) el.firstChild.remove(); return el; };

export function fmt(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return v.toLocaleString();
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return v.toFixed(digits);
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

export const parseTime = (t) => (t ? new Date(/[zZ]|[+-]\d\d:\d\d$/.test(t) ? t : t + "Z") : null);

export function ago(t) {
  const d = parseTime(t);
  return d ? `${duration((Date.now() - d.getTime()) / 1000)} ago` : "–";
}

export function runTime(job) {
  const start = parseTime(job.started_at);
  if (!start) return null;
  const end = parseTime(job.finished_at) || new Date();
  return (end - start) / 1000;
}

export const badge = (status) => h("span", { class: `badge ${status}`, "data-status": status }, status);

export function progress(step, total) {
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  return h("div", {},
    h("div", { class: "progress", role: "progressbar", "aria-valuenow": step, "aria-valuemax": total },
      h("span", { style: { width: `${pct}%` } })),
    h("div", { class: "progress-label" }, `${step} / ${total}`));
}

export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

export function size(bytes) {
  if (bytes < 1e3) return `${bytes} B`;
  if (bytes < 1e6) return `${fmt(bytes / 1e3, 1)} kB`;
  if (bytes < 1e9) return `${fmt(bytes / 1e6, 1)} MB`;
  return `${fmt(bytes / 1e9, 2)} GB`;
}
