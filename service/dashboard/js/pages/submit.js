// Paste or upload a YAML/JSON spec; errors appear under the lines of the fields they name.
import { api } from "../api.js";
import { h } from "../dom.js";
import { FIELD_OF, listFiles } from "./files.js";

const EXAMPLE = `kind: grpo
name: my-first-job
model:
  name: tiny-random-llama
  lora: {r: 8, alpha: 16}
dataset:
  name: arith
rewards:
  - name: numeric_match
grpo:
  steps: 20
  prompts_per_step: 4
  num_generations: 4
  max_new_tokens: 16
  learning_rate: 1.0e-3
`;

export async function submitPage({ app }) {
  const text = h("textarea", { id: "spec-text", spellcheck: false }, EXAMPLE);
  const file = h("input", { type: "file", id: "spec-file", accept: ".yaml,.yml,.json,application/json,text/yaml" });
  const status = h("div", { id: "submit-status" });
  const annotated = h("div", { class: "annotated", id: "spec-annotated" });
  const render = (errors = []) => {
    const byLine = new Map();
    const unplaced = [];
    for (const e of errors) (e.line ? (byLine.get(e.line) || byLine.set(e.line, []).get(e.line)) : unplaced).push(e);
    const lines = text.value.split("\n");
    annotated.replaceChildren(
      ...unplaced.map((e) => h("div", { class: "field-error", "data-field": e.field }, `${e.field || "spec"}: ${e.message}`)),
      ...lines.flatMap((line, i) => [
        h("div", { class: `line${byLine.has(i + 1) ? " has-error" : ""}`, "data-line": i + 1 }, h("span", { class: "no" }, i + 1), line || " "),
        ...(byLine.get(i + 1) || []).map((e) => h("div", { class: "field-error", "data-field": e.field }, `↑ ${e.field || "spec"}: ${e.message}`)),
      ]));
  };
  const validate = async () => {
    const check = await api("/v1/specs/validate", { method: "POST", text: text.value });
    render(check.detail);
    if (check.valid) {
      status.replaceChildren(h("div", { class: "ok-box", id: "spec-ok" }, `Valid ${check.kind} spec.`));
      return check.spec;
    }
    const n = check.detail.length;
    status.replaceChildren(h("div", { class: "error-box", id: "spec-errors" }, `${n} problem${n > 1 ? "s" : ""}: ${check.message}`));
    return null;
  };
  const submit = async () => {
    const spec = await validate();
    if (!spec) return;
    const job = await api("/v1/jobs", { method: "POST", json: spec, headers: { "Idempotency-Key": crypto.randomUUID?.() ?? `${Date.now()}-${Math.random()}` } });
    location.hash = `#/jobs/${job.id}`;
  };
  file.addEventListener("change", async () => { if (file.files[0]) { text.value = await file.files[0].text(); render(); status.replaceChildren(); } });
  text.addEventListener("input", () => render());
  app.append(h("h1", {}, "Submit a job"),
    h("p", { class: "muted" }, "A job spec in YAML or JSON (see docs/guide/specs.md and examples/). ",
      "Validation fills in every default; errors are shown under the lines that name them."),
    h("div", { class: "toolbar" }, file,
      h("button", { id: "validate-btn", onclick: () => validate() }, "Validate"),
      h("button", { class: "primary", id: "submit-btn", onclick: () => submit().catch((e) => status.replaceChildren(h("div", { class: "error-box" }, e.message))) }, "Submit")),
    status,
    h("div", { class: "submit-layout" }, text, annotated),
    await filesPanel(text, render),
    await rewardsPanel(text, render));
  render();
}

const insertAt = (text, snippet) => {
  const at = text.selectionStart ?? text.value.length;
  text.value = text.value.slice(0, at) + snippet + text.value.slice(at);
};

// Your uploaded files: "insert" puts the id at the cursor (after `train_file: `, say).
async function filesPanel(text, render) {
  const files = await listFiles();
  return h("section", { id: "files-panel" },
    h("h2", {}, "Your files"),
    h("p", { class: "muted" }, "Train on them with ", h("code", {}, "dataset: {name: file, train_file: <id>}"),
      "; upload more on the ", h("a", { href: "#/files" }, "Files"), " page."),
    files.length ? h("table", { class: "table" },
      h("thead", {}, h("tr", {}, ...["id", "purpose", "name", "rows", ""].map((c) => h("th", {}, c)))),
      h("tbody", {}, ...files.map((f) => h("tr", { "data-file": f.id },
        h("td", {}, h("code", {}, f.id)), h("td", {}, `${f.purpose} (${FIELD_OF[f.purpose]})`), h("td", {}, f.filename),
        h("td", { class: "num" }, f.rows),
        h("td", {}, h("button", { class: "insert-file", onclick: () => { insertAt(text, f.id); render(); } }, "insert"))))))
      : h("p", { class: "muted", id: "no-files" }, "No files uploaded yet."));
}

// The rewards this deployment offers (GET /v1/rewards); "insert" puts an entry at the cursor.
async function rewardsPanel(text, render) {
  const { items, http_url_prefixes: prefixes } = await api("/v1/rewards");
  const snippet = (r) => {
    const required = r.parameters.filter((p) => p.required).map((p) => `, ${p.name}: ${p.name === "url" && prefixes.length ? JSON.stringify(prefixes[0]) : '""'}`);
    return `  - {name: ${r.name}, weight: 1.0${required.join("")}}\n`;
  };
  const insert = (r) => { insertAt(text, snippet(r)); render(); };
  const row = (r) => h("tr", { "data-reward": r.name },
    h("td", {}, h("code", {}, r.name)), h("td", {}, r.kind), h("td", {}, r.description),
    h("td", {}, r.parameters.map((p) => h("div", { title: p.description || "" }, h("code", {}, p.name),
      p.required ? " (required)" : ` = ${JSON.stringify(p.default)}`))),
    h("td", {}, h("button", { class: "insert-reward", onclick: () => insert(r) }, "insert")));
  return h("section", { id: "rewards-panel" },
    h("h2", {}, "Rewards on this deployment"),
    h("p", { class: "muted" }, "Entries of a spec's `rewards` list; each has a name and a weight, plus its kind's parameters. ",
      prefixes.length ? `http graders may be at: ${prefixes.join(", ")}.` : "This deployment allows no http graders."),
    h("table", { class: "table" }, h("thead", {}, h("tr", {}, ...["name", "kind", "what it does", "parameters", ""].map((c) => h("th", {}, c)))),
      h("tbody", {}, ...items.map(row))));
}
