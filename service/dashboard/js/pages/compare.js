// Overlay one metric of two or more jobs: #/compare?ids=1,2,3&metric=reward/mean
import { api, metrics, qs } from "../api.js";
import { overlayChart } from "../charts.js";
import { badge, h } from "../dom.js";

export async function comparePage({ app, query }) {
  const ids = (query.get("ids") || "").split(",").map(Number).filter((n) => Number.isInteger(n) && n > 0);
  app.append(h("h1", {}, "Compare jobs"));
  if (ids.length < 2) return pickJobs(app, ids);
  const jobs = await Promise.all(ids.map((id) => api(`/v1/jobs/${id}`)));
  const keySets = await Promise.all(ids.map((id) => metrics(id, { keys: ["_"], maxPoints: 2 }).then((b) => b.keys)));
  const keys = [...new Set(keySets.flat())].sort();
  const metric = query.get("metric") || (keys.includes("reward/mean") ? "reward/mean" : keys[0]);
  const pick = h("select", { id: "compare-metric", onchange: (e) => {
    location.hash = `#/compare${qs({ ids: ids.join(","), metric: e.target.value })}`;
  } }, keys.map((k) => h("option", { value: k, selected: k === metric }, k)));
  app.append(h("div", { class: "toolbar" }, "Metric ", pick,
    jobs.map((j) => h("span", {}, h("a", { href: `#/jobs/${j.id}` }, `#${j.id} ${j.name || ""}`), " ", badge(j.status)))));
  if (!metric) { app.append(h("p", { class: "muted" }, "These jobs have no metrics yet.")); return; }
  const series = await Promise.all(ids.map((id) => metrics(id, { keys: [metric] })));
  const tables = series.map((b, i) => ({
    label: `#${jobs[i].id} ${jobs[i].name || ""}`.trim(),
    x: b.series[0].points.map((p) => p.step), y: b.series[0].points.map((p) => p.value),
  }));
  app.append(h("div", { id: "compare-chart" }, overlayChart(metric, tables)));
}

async function pickJobs(app, preselected) {
  const page = await api("/v1/jobs?limit=100");
  const picked = new Set(preselected);
  const go = h("button", { class: "primary", id: "compare-go", disabled: picked.size < 2,
    onclick: () => { location.hash = `#/compare?ids=${[...picked].join(",")}`; } }, "Compare");
  app.append(h("p", { class: "muted" }, "Pick two or more jobs."),
    h("table", {}, h("tbody", {}, page.items.map((j) => h("tr", {},
      h("td", {}, h("input", { type: "checkbox", checked: picked.has(j.id), "data-job-id": j.id,
        onchange: (e) => { e.target.checked ? picked.add(j.id) : picked.delete(j.id); go.disabled = picked.size < 2; } })),
      h("td", {}, `#${j.id}`), h("td", {}, j.name || ""), h("td", {}, j.kind), h("td", {}, badge(j.status)))))),
    h("div", { class: "toolbar", style: { marginTop: "10px" } }, go));
}
