// Every job of the signed-in owner, filtered by status and kind, refreshed every few seconds.
import { api, qs } from "../api.js";
import { ago, badge, duration, fmt, h, progress, runTime } from "../dom.js";

const STATUSES = ["", "queued", "running", "idle", "succeeded", "failed", "cancelled"];
// session: a run driven from the tinker SDK (/api/v1), one optim_step a step
const KINDS = ["", "grpo", "tracin", "joint", "sft", "session"];
const PAGE = 50;
const REFRESH_MS = 3000;

export async function jobsPage({ app, query, onLeave }) {
  const state = { status: query.get("status") || "", kind: query.get("kind") || "", cursors: [null] };
  const picked = new Set();
  const select = (name, options) => h("select", {
    id: `filter-${name}`, onchange: (e) => { state[name] = e.target.value; state.cursors = [null]; sync(); load(); },
  }, options.map((o) => h("option", { value: o, selected: o === state[name] }, o || `any ${name}`)));
  const compare = h("button", { id: "compare-btn", disabled: true, onclick: () => {
    location.hash = `#/compare?ids=${[...picked].join(",")}`;
  } }, "Compare selected");
  const prev = h("button", { onclick: () => { state.cursors.pop(); load(); } }, "← Newer");
  const next = h("button", { onclick: () => { state.cursors.push(state.next); load(); } }, "Older →");
  const body = h("tbody", { id: "jobs-body" });
  const empty = h("p", { class: "muted", hidden: true }, "No jobs yet. ", h("a", { href: "#/submit" }, "Submit one"), ".");
  const updated = h("span", { class: "muted", id: "jobs-updated" });
  app.append(
    h("h1", {}, "Jobs"),
    h("div", { class: "toolbar" }, select("status", STATUSES), select("kind", KINDS), compare,
      h("span", { class: "spacer" }), updated),
    h("table", { id: "jobs-table" },
      h("thead", {}, h("tr", {}, h("th", {}, ""), h("th", {}, "id"), h("th", {}, "name"), h("th", {}, "kind"),
        h("th", {}, "model"), h("th", {}, "status"), h("th", {}, "progress"), h("th", { class: "num" }, "reward"),
        h("th", { class: "num" }, "eval acc"), h("th", {}, "created"), h("th", {}, "run time"))),
      body),
    empty, h("div", { class: "toolbar", style: { marginTop: "10px" } }, prev, next));

  function sync() {
    const q = qs({ status: state.status, kind: state.kind });
    history.replaceState(null, "", `#/jobs${q}`);
  }

  function row(job) {
    const latest = job.latest || {};
    const box = h("input", { type: "checkbox", checked: picked.has(job.id), onclick: (e) => e.stopPropagation(),
      onchange: (e) => { e.target.checked ? picked.add(job.id) : picked.delete(job.id); compare.disabled = picked.size < 2; } });
    return h("tr", { class: "clickable", "data-job-id": job.id, onclick: () => { location.hash = `#/jobs/${job.id}`; } },
      h("td", {}, box), h("td", {}, job.id), h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.name || `job ${job.id}`)),
      h("td", {}, job.kind), h("td", {}, job.spec?.model?.name ?? "–"), h("td", {}, badge(job.status)),
      h("td", {}, progress(job.step, job.total_steps)),
      h("td", { class: "num", "data-metric": "reward/mean" }, fmt(latest["reward/mean"]?.value)),
      h("td", { class: "num" }, fmt(latest["eval/accuracy"]?.value)),
      h("td", { title: job.created_at }, ago(job.created_at)), h("td", {}, duration(runTime(job))));
  }

  async function load() {
    const page = await api("/v1/jobs" + qs({
      status: state.status, kind: state.kind, limit: PAGE, after: state.cursors.at(-1),
      latest: "reward/mean,eval/accuracy",
    }));
    state.next = page.next_after;
    body.replaceChildren(...page.items.map(row));
    empty.hidden = page.items.length > 0 || state.cursors.length > 1;
    prev.disabled = state.cursors.length <= 1;
    next.disabled = !page.has_more;
    updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
  }

  await load();
  const timer = setInterval(() => load().catch(() => {}), REFRESH_MS);
  onLeave(() => clearInterval(timer));
}
