// The job page's report sections: TracIn selections, sparsity reports, samples, events, checkpoints.
import { api, auth, qs } from "../api.js";
import { categoryChart, heatmap, histogramChart, overlayChart, scatterChart } from "../charts.js";
import { fmt, h, parseTime, size } from "../dom.js";

const section = (title, id, ...children) => h("section", { id }, h("h2", {}, title), ...children);
const stepSelect = (id, items, label, onchange) => h("select", { id, onchange: (e) => onchange(Number(e.target.value)) },
  items.map((it, i) => h("option", { value: i, selected: i === items.length - 1 }, label(it))));

/** Per-step TracIn selections: the influence histogram of a chosen step and its summary. */
export function selectionSection(jobId) {
  const body = h("div", {});
  const load = async () => {
    const sels = await api(`/v1/jobs/${jobId}/selections?scores=false&limit=10000`);
    if (!sels.length) { body.replaceChildren(h("p", { class: "muted" }, "No selections recorded yet.")); return; }
    const show = (i) => {
      const s = sels[i];
      detail.replaceChildren(
        h("p", { id: "selection-summary" }, `step ${s.step} (${s.policy}): ${s.selected} of ${s.total} selected `,
          `(ratio ${fmt(s.ratio)}), influence mean ${fmt(s.mean_influence, 4)}, min ${fmt(s.min_influence, 4)}, max ${fmt(s.max_influence, 4)}`),
        h("div", { class: "grid" }, histogramChart(`Influence histogram, step ${s.step}`, s.histogram.edges, s.histogram.counts,
          "positive scores: training on the sample lowers the validation loss")));
    };
    const detail = h("div", {});
    body.replaceChildren(h("div", { class: "toolbar" }, "Step ",
      stepSelect("selection-step", sels, (s) => `${s.step}: ${s.selected}/${s.total}`, show),
      h("button", { onclick: load }, "Refresh")), detail);
    show(sels.length - 1);
  };
  load();
  return section("TracIn selections", "selections", body);
}

const interval = (iv) => (iv ? `${fmt(iv.estimate, 3)} [${fmt(iv.low, 3)}, ${fmt(iv.high, 3)}]` : "–");

/** TracIn's prediction checked: each step's predicted change of the validation objective against the actual one. */
export function predictionSection(jobId) {
  const body = h("div", {});
  const load = async () => {
    const c = await api(`/v1/jobs/${jobId}/tracin/prediction`);
    if (!c.points.length) { body.replaceChildren(h("p", { class: "muted" }, "No step checked yet (tracin.check_prediction, a selection by influence).")); return; }
    body.replaceChildren(
      h("div", { class: "toolbar" }, h("button", { onclick: load }, "Refresh")),
      h("p", { id: "prediction-summary" }, `${c.update.n} step${c.update.n === 1 ? "" : "s"}: Pearson ${interval(c.update.pearson)}, `,
        `Spearman ${interval(c.update.spearman)} (95% bootstrap intervals); from the influence scores alone: `,
        `Pearson ${interval(c.influence.pearson)}`),
      h("div", { class: "grid" }, scatterChart("Predicted against actual change of L_val",
        c.points.map((p) => ({ x: p.predicted, y: p.actual })),
        { xLabel: "predicted <G_val, Δθ>", yLabel: "actual ΔL_val",
          note: "one point per step; on the dashed line the first-order prediction is exact" })));
  };
  load();
  return section("TracIn prediction check", "prediction", body);
}

const thresholdLabels = (obj) => Object.keys(obj).sort((a, b) => Number(a) - Number(b));

/** Parameter-update sparsity: against threshold, magnitude vs random quality, layer x component heatmap. */
export function sparsitySection(jobId) {
  const body = h("div", {});
  const show = async (r) => {
    const { report } = await api(`/v1/jobs/${jobId}/sparsity/${r.id}`);
    const labels = thresholdLabels(report.sparsity);
    const charts = [categoryChart("Unchanged fraction against threshold", labels,
      [{ label: "adapter", y: labels.map((t) => report.sparsity[t]) },
       ...(report.merged ? [{ label: "merged weights", y: labels.map((t) => report.merged.sparsity[t] ?? null) }] : [])],
      "fraction of parameters whose change is at most the threshold")];
    const precise = report.merged?.precision ?? report.precision; // LoRA: the merged weights compare with released models
    if (precise) {
      const tl = Object.keys(precise.fp32);
      charts.push(categoryChart(`Unchanged at the literature's tolerances${report.merged?.precision ? " (merged weights)" : ""}`, tl,
        [{ label: "float32", y: tl.map((t) => precise.fp32[t]) }, { label: "bfloat16 (both rounded)", y: tl.map((t) => precise.bf16[t]) }],
        "fraction with |Δ| ≤ tolerance; bf16 rounding hides updates below half a bf16 step"));
    }
    if (report.quality?.length) {
      const q = [...report.quality].sort((a, b) => a.threshold - b.threshold);
      const ql = q.map((row) => `${row.threshold} (${fmt(row.density, 2)})`);
      charts.push(
        categoryChart("Partial update: KL to the full update", ql,
          [{ label: "largest changes kept", y: q.map((x) => x.magnitude.kl) }, { label: "random, same count", y: q.map((x) => x.random.kl) }],
          "x: threshold (fraction of the update kept); lower is closer to the full update"),
        categoryChart("Partial update: top-1 agreement", ql,
          [{ label: "largest changes kept", y: q.map((x) => x.magnitude.top1_agreement) }, { label: "random, same count", y: q.map((x) => x.random.top1_agreement) }]));
    }
    if (report.per_layer_component) charts.push(heatmap(`Unchanged fraction by layer × component (threshold ${report.primary_threshold})`, "layer", report.per_layer_component));
    if (report.merged?.per_layer_component) charts.push(heatmap("Merged weights: layer × component", "layer", report.merged.per_layer_component));
    detail.replaceChildren(h("p", { id: "sparsity-summary" }, `steps ${r.from_step}→${r.step} (${r.scope}): `,
      `${fmt(100 * report.sparsity_primary, 2)}% unchanged, sign flips ${fmt(report.sign_flip_ratio, 4)}`,
      report.kl_task != null ? `, KL(π₀ ‖ π) on the task ${fmt(report.kl_task, 4)} nats per completion` : ""), h("div", { class: "grid" }, charts));
  };
  const detail = h("div", {});
  (async () => {
    const reports = await api(`/v1/jobs/${jobId}/sparsity?full=false`);
    if (!reports.length) { body.replaceChildren(h("p", { class: "muted" }, "No sparsity reports yet.")); return; }
    // The curves: does the share of untouched weights fall as training goes on, per interval and in all?
    const curve = (scope, label) => {
      const rs = reports.filter((r) => r.scope === scope);
      return { label, x: rs.map((r) => r.step), y: rs.map((r) => r.sparsity) };
    };
    body.replaceChildren(
      h("div", { class: "grid" }, overlayChart("Unchanged fraction over training",
        [curve("window", "since the last report"), curve("cumulative", "since the start")])),
      h("div", { class: "toolbar" }, "Report ",
        stepSelect("sparsity-report", reports, (r) => `${r.scope} ${r.from_step}→${r.step}: ${fmt(r.sparsity)}`, (i) => show(reports[i]))), detail);
    show(reports.at(-1));
  })();
  return section("Sparsity reports", "sparsity", body);
}

/** An episode (a job with an environment), turn by turn: the model's turn, then the environment's answer. */
function episodeCell(ep) {
  const turns = ep.turns.map((t, i) => h("div", { class: "turn" },
    h("div", { class: "model" }, h("b", {}, `turn ${i + 1} `), t.action,
      h("span", { class: "muted" }, t.trained_tokens === undefined ? "" : `  (${t.trained_tokens} trained tokens)`)),
    h("div", { class: "env" + (t.tool_error ? " error" : "") },
      h("b", {}, t.tool_call ? "tool " : "env "), t.observation ?? "(no answer)",
      h("span", { class: "muted" }, t.reward === null ? "" : `  reward ${fmt(t.reward)}`))));
  const end = ep.error ? `failed: ${ep.error}` : ep.done ? "done" : ep.truncated ? "truncated" : "ended";
  const tok = ep.tokens;
  return h("td", { class: "text episode" }, ...turns,
    h("div", { class: "muted" }, `${end} · seed ${ep.seed} · ${tok.sampled} sampled + ${tok.environment} environment tokens`));
}

/** Recorded completions, filterable by step. */
export function samplesSection(jobId, job) {
  const input = h("input", { type: "number", min: 0, id: "samples-step", placeholder: "latest step", style: { width: "9em" } });
  const tbody = h("tbody", { id: "samples-body" });
  const note = h("span", { class: "muted" });
  let follow = true; // show the newest step until the user picks one
  const load = async (step) => {
    const rows = await api(`/v1/jobs/${jobId}/samples` + qs({ step, limit: 200 }));
    note.textContent = `${rows.length} samples of step ${step}`;
    tbody.replaceChildren(...rows.map((s) => h("tr", {},
      h("td", { class: "num" }, s.step), h("td", { class: "text" }, s.prompt),
      s.extra?.episode ? episodeCell(s.extra.episode) : h("td", { class: "text" }, s.completion),
      h("td", { class: "num" }, fmt(s.reward)), h("td", { class: "num" }, fmt(s.advantage)),
      h("td", { class: "num" }, fmt(s.influence, 4)), h("td", {}, s.selected === null ? "–" : s.selected ? "yes" : "no"))));
  };
  input.addEventListener("change", () => { follow = input.value === ""; load(follow ? job.step : Number(input.value)); });
  if (job.step > 0) load(job.step);
  const el = section("Samples", "samples",
    h("div", { class: "toolbar" }, "Step ", input, note),
    h("table", { class: "samples" }, h("thead", {}, h("tr", {}, ["step", "prompt", "completion", "reward", "advantage", "influence", "selected"].map((c) => h("th", {}, c)))), tbody));
  return { el, refreshIfLatest: (step) => { if (follow) load(step); } };
}

/** The job's events, newest last; live ones are appended. */
export function eventsSection(jobId) {
  const list = h("div", { class: "events card", id: "events" });
  const seen = new Set();
  const add = (e) => {
    if (seen.has(e.id)) return;
    seen.add(e.id);
    const t = parseTime(e.created_at);
    list.append(h("div", { class: e.level, "data-type": e.type }, `${t ? t.toLocaleTimeString() : ""}  ${e.type.padEnd(10)} ${e.message}`));
    list.scrollTop = list.scrollHeight;
  };
  api(`/v1/jobs/${jobId}/events?limit=1000`).then((evs) => evs.forEach(add));
  return { el: section("Events", "events-section", list), add };
}

export function checkpointsSection(jobId) {
  const tbody = h("tbody", { id: "checkpoints-body" });
  const reload = async () => {
    const rows = await api(`/v1/jobs/${jobId}/checkpoints`);
    tbody.replaceChildren(...(rows.length ? rows.map((c) => h("tr", {},
      h("td", { class: "num" }, c.step), h("td", {}, c.format), h("td", { class: "num" }, size(c.size_bytes)),
      h("td", {}, parseTime(c.created_at)?.toLocaleString() ?? ""),
      h("td", {}, h("button", { class: "download-ckpt", "data-step": c.step, onclick: (e) => download(jobId, c.step, e.target) }, "download"))))
      : [h("tr", {}, h("td", { colspan: 5, class: "muted" }, "No checkpoints yet."))]));
  };
  reload();
  return { el: section("Checkpoints", "checkpoints",
    h("table", {}, h("thead", {}, h("tr", {}, ["step", "format", "size", "saved", ""].map((c) => h("th", {}, c)))), tbody)), reload };
}

// The archive needs the key in a header, so a plain link cannot fetch it: fetch, then save the blob.
async function download(jobId, step, button) {
  button.disabled = true;
  button.textContent = "downloading…";
  try {
    const r = await fetch(`/v1/jobs/${jobId}/checkpoints/${step}/archive`, { headers: { Authorization: `Bearer ${auth.key}` } });
    if (!r.ok) throw new Error((await r.json().catch(() => ({}))).detail || `HTTP ${r.status}`);
    const url = URL.createObjectURL(await r.blob());
    const a = h("a", { href: url, download: `job-${jobId}-step-${step}.tar.gz` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
    button.textContent = "download";
  } catch (e) {
    button.textContent = `failed: ${e.message}`;
  } finally {
    button.disabled = false;
  }
}
