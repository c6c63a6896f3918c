// One job: header with progress and ETA, live charts of every metric, reports, samples, events, checkpoints.
// Running jobs update from the server-sent-events stream (or incremental polls where it cannot stay open, live.js); long series come bucketed from the server,
// and a drag-zoom refetches the selected range at full resolution.
import { api, metrics } from "../api.js";
import { follow } from "../live.js";
import { StepChart } from "../charts.js";
import { TERMINAL, badge, duration, h, progress, runTime } from "../dom.js";
import { SECTIONS, claimed, keysOf } from "../panels.js";
import { checkpointsSection, eventsSection, predictionSection, samplesSection, selectionSection, sparsitySection } from "./reports.js";

export async function jobPage({ app, onLeave }, id) {
  let job = await api(`/v1/jobs/${id}`);
  const head = h("div", { id: "job-header" });
  const chartsRoot = h("div", { id: "charts" });
  const events = eventsSection(id);
  const checkpoints = checkpointsSection(id);
  const samples = samplesSection(id, job);
  app.append(head, chartsRoot);
  if (job.kind === "tracin") app.append(selectionSection(id), predictionSection(id));
  if (job.spec?.sparsity) app.append(sparsitySection(id));
  app.append(samples.el, events.el, checkpoints.el);
  const fingerprint = h("section", { id: "fingerprint" });
  app.append(fingerprint);
  const renderFingerprint = () => fingerprint.replaceChildren(...fingerprintSection(job.fingerprint));
  renderFingerprint();

  // A job on several machines: which worker runs each node of its latest attempt, reloaded as nodes join.
  let nodes = [];
  const multiNode = (job.spec?.resources?.nodes ?? 1) > 1;
  const loadNodes = () => multiNode && api(`/v1/jobs/${id}/nodes`).then((r) => { nodes = r.items; renderHeader(); });
  const renderHeader = () => head.replaceChildren(header(job, async () => {
    job = await api(`/v1/jobs/${id}/cancel`, { method: "POST" });
    renderHeader();
  }, multiNode ? nodes : null));
  renderHeader();
  loadNodes();

  // Charts: one per panel that has data, created as keys appear.
  const charts = new Map(); // panel -> StepChart
  const grids = new Map(); // section title -> grid element
  const known = new Set();
  const zoom = (chart) => async (from, to) => {
    const body = await metrics(id, { keys: chart.keys, fromStep: from ?? undefined, toStep: to ?? undefined });
    chart.load(Object.fromEntries(body.series.map((s) => [s.key, s])), { keepScale: from !== null });
  };
  function ensureCharts(keys) {
    keys.forEach((k) => known.add(k));
    const all = [...known].sort();
    const other = { title: "Other", panels: all.filter((k) => !claimed(k)).map((k) => ({ title: k, keys: [k] })) };
    for (const section of [...SECTIONS, other]) {
      for (const panel of section.panels) {
        const mine = keysOf(panel, all);
        if (!mine.length) continue;
        let chart = charts.get(panel.title);
        if (!chart) {
          chart = new StepChart({ title: panel.title, keys: mine, band: panel.band, note: panel.note });
          chart.onZoom = zoom(chart);
          charts.set(panel.title, chart);
          if (!grids.has(section.title)) {
            const grid = h("div", { class: "grid" });
            grids.set(section.title, grid);
            chartsRoot.append(h("section", { "data-section": section.title }, h("h2", {}, section.title), grid));
          }
          grids.get(section.title).append(chart.el);
        } else {
          for (const k of mine) if (!chart.keys.includes(k)) chart.keys.push(k);
        }
      }
    }
  }

  const first = await metrics(id);
  ensureCharts(first.keys);
  const byKey = Object.fromEntries(first.series.map((s) => [s.key, s]));
  for (const chart of charts.values()) chart.load(byKey);
  const lastStep = Math.max(-1, ...first.series.flatMap((s) => s.points.map((p) => p.step)));
  if (!first.keys.length) chartsRoot.append(h("p", { class: "muted", id: "no-metrics" }, "No metrics yet: charts appear with the first step."));

  if (TERMINAL.has(job.status)) return;
  const stop = follow(id, { lastStep, on: {
    status(s) {
      const changed = s.status !== job.status;
      Object.assign(job, s);
      renderHeader();
      if (changed) api(`/v1/jobs/${id}`).then((j) => { job = j; renderHeader(); });
    },
    metrics(step, values) {
      document.getElementById("no-metrics")?.remove();
      ensureCharts(Object.keys(values));
      for (const chart of charts.values()) chart.append(step, values);
      samples.refreshIfLatest(step);
    },
    event(ev) {
      events.add(ev);
      if (ev.type === "node") loadNodes();
      if (ev.type === "health" || ev.type === "fingerprint") {
        api(`/v1/jobs/${id}`).then((j) => { job = j; renderHeader(); renderFingerprint(); });
      }
    },
    end() {
      api(`/v1/jobs/${id}`).then((j) => { job = j; renderHeader(); });
      checkpoints.reload();
    },
  } });
  onLeave(stop);
}

function header(job, cancel, nodes) {
  const spec = job.spec || {};
  const elapsed = runTime(job);
  const eta = job.status === "running" && job.step > 0 && job.total_steps > 0 && elapsed ? (elapsed / job.step) * (job.total_steps - job.step) : null;
  const rewards = (spec.rewards || []).map((r) => (r.weight !== undefined && r.weight !== 1 ? `${r.name}×${r.weight}` : r.name)).join(", ");
  const canCancel = !TERMINAL.has(job.status) && !job.cancel_requested;
  return h("div", { class: "header-row" },
    h("div", { class: "card" },
      h("h1", {}, job.name || `job ${job.id}`, " ", badge(job.status)),
      healthBadges(job.health),
      h("dl", { class: "kv" },
        h("dt", {}, "id"), h("dd", {}, job.id),
        h("dt", {}, "kind"), h("dd", {}, job.kind),
        h("dt", {}, "model"), h("dd", {}, spec.model ? `${spec.model.name}${spec.model.lora ? ` (LoRA r=${spec.model.lora.r})` : " (full fine-tuning)"}` : "–"),
        h("dt", {}, "dataset"), h("dd", {}, spec.dataset?.name ?? "–"),
        h("dt", {}, "rewards"), h("dd", {}, rewards || "–"),
        h("dt", {}, "batch"), h("dd", {}, spec.grpo?.prompts_per_step
          ? `${spec.grpo.prompts_per_step} prompts × ${spec.grpo.num_generations} completions, lr ${spec.grpo.learning_rate}`
          : spec.sft ? `${spec.sft.batch_size} examples a step, lr ${spec.sft.learning_rate}` : "–"))),
    h("div", { class: "card" },
      progress(job.step, job.total_steps),
      h("dl", { class: "kv", style: { marginTop: "10px" } },
        h("dt", {}, "run time"), h("dd", {}, duration(elapsed)),
        h("dt", {}, "ETA"), h("dd", { id: "eta" }, eta === null ? "–" : duration(eta)),
        h("dt", {}, "attempt"), h("dd", {}, job.attempt),
        nodes ? [h("dt", {}, "nodes"), h("dd", { id: "nodes" }, nodes.length
          ? nodes.map((n) => h("div", { "data-node": n.node }, n.node_name === null  // the admin's keys see where
            ? `node ${n.node} (attempt ${n.attempt})` : `node ${n.node}: ${n.node_name} (${n.holder}, attempt ${n.attempt})`))
          : `${job.spec.resources.nodes} machines, none joined yet`)] : null),
      job.error ? h("div", { class: "error-box", id: "job-error" }, job.error) : null,
      job.cancel_requested && !TERMINAL.has(job.status) ? h("p", { class: "muted" }, "Cancel requested: stopping after the current step.") : null,
      canCancel ? h("button", { class: "danger", id: "cancel-btn", onclick: cancel }, "Cancel job") : null));
}

// One badge per health guard of the job's kind: green until flagged, amber or red while it is; the
// tooltip says why (service/core/health.py).
function healthBadges(health) {
  if (!health || !Object.keys(health.guards).length) return null;
  return h("div", { class: "health", id: "health", "data-level": health.level },
    Object.entries(health.guards).map(([guard, flag]) => h("span", {
      class: `badge ${flag ? flag.level : "ok"}`, "data-guard": guard, "data-level": flag ? flag.level : "ok",
      title: flag ? flag.message : `${guard}: within its band`,
    }, guard.replace("_", " "))));
}

// What the latest attempt ran: `grpo-jobs reproduce ID --wait` submits it again and compares.
function fingerprintSection(fp) {
  if (!fp) return [h("h2", {}, "Fingerprint"), h("p", { class: "muted" }, "Recorded when an attempt starts.")];
  const hw = fp.hardware;
  const rows = [
    ["spec", fp.spec_sha256], ["data", fp.data_sha256], ["model weights", fp.model_sha256], ["base weights' dtype", fp.dtype || "not recorded"],
    ["starting weights", fp.trainable_sha256 || "not recorded"],
    ["grpo-jobs", fp.commit ? `${fp.version} (${fp.commit})` : fp.version],
    ["libraries", Object.entries(fp.libraries).map(([k, v]) => `${k} ${v}`).join(", ")],
    ["hardware", `${hw.cpu}, ${hw.cores} cores, ${hw.threads} threads, ${hw.cpu_capability}${hw.gpus.length ? `, ${hw.gpus.join(", ")}` : ""} (trains on ${hw.device})`],
    ["seeds", Object.entries(fp.seeds).map(([k, v]) => `${k} ${v}`).join(", ")], ["processes", fp.processes],
  ];
  return [h("h2", {}, "Fingerprint"), h("dl", { class: "kv card" }, rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { "data-field": k }, v)]))];
}
