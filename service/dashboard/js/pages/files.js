// Files: upload data (JSONL or Parquet) with a progress bar, list and delete your files.
import { ApiError, api, auth, qs } from "../api.js";
import { fmt, h, parseTime, size } from "../dom.js";

// The dataset field of a spec that names a file of each purpose.
export const FIELD_OF = { train: "train_file", eval: "val_file", corpus: "corpus_file" };

// fetch() reports no upload progress; XMLHttpRequest does.
function upload(file, purpose, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    const form = new FormData();
    form.append("purpose", purpose);
    form.append("file", file);
    xhr.open("POST", "/v1/files");
    xhr.setRequestHeader("Authorization", `Bearer ${auth.key}`);
    xhr.upload.onprogress = (e) => e.lengthComputable && onProgress(e.loaded / e.total);
    xhr.onload = () => {
      let body = xhr.responseText;
      try { body = JSON.parse(body); } catch { /* not JSON: keep the text */ }
      xhr.status === 201 ? resolve(body) : reject(new ApiError(xhr.status, body));
    };
    xhr.onerror = () => reject(new Error("the upload failed: the service could not be reached"));
    xhr.send(form);
  });
}

export async function listFiles(purpose) {
  const items = [];
  let after = null;
  do {
    const page = await api("/v1/files" + qs({ purpose, after, limit: 200 }));
    items.push(...page.items);
    after = page.has_more ? page.next_after : null;
  } while (after);
  return items;
}

export async function filesPage({ app }) {
  const input = h("input", { type: "file", id: "file-input", accept: ".jsonl,.json,.parquet" });
  const purpose = h("select", { id: "file-purpose" }, ["train", "eval", "corpus"].map((p) => h("option", { value: p }, p)));
  const bar = h("span", { style: { width: "0%" } });
  const progress = h("div", { class: "progress", id: "upload-progress", hidden: true }, bar);
  const status = h("div", { id: "upload-status" });
  const tbody = h("tbody", { id: "files-body" });
  const reload = async () => {
    const files = await listFiles();
    tbody.replaceChildren(...(files.length ? files.map((f) => h("tr", { "data-file": f.id },
      h("td", {}, h("code", {}, f.id)), h("td", {}, f.purpose), h("td", {}, f.filename), h("td", {}, f.format),
      h("td", { class: "num" }, fmt(f.rows)), h("td", { class: "num" }, size(f.bytes)),
      h("td", {}, parseTime(f.created_at)?.toLocaleString() ?? ""),
      h("td", {}, h("button", { class: "danger delete-file", onclick: () => remove(f) }, "delete"))))
      : [h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No files yet."))]));
  };
  const remove = async (f) => {
    if (!confirm(`Delete ${f.filename} (${f.id})?`)) return;
    try {
      await api(`/v1/files/${f.id}`, { method: "DELETE" });
      status.replaceChildren();
    } catch (e) {
      status.replaceChildren(h("div", { class: "error-box" }, e.message));
    }
    await reload();
  };
  const send = async () => {
    const file = input.files[0];
    if (!file) { status.replaceChildren(h("div", { class: "error-box" }, "Choose a file first.")); return; }
    progress.hidden = false;
    bar.style.width = "0%";
    status.replaceChildren();
    try {
      const f = await upload(file, purpose.value, (p) => { bar.style.width = `${Math.round(100 * p)}%`; });
      status.replaceChildren(h("div", { class: "ok-box", id: "upload-ok" }, `Uploaded ${f.filename}: `, h("code", {}, f.id),
        ` (${f.rows} rows). Name it in a spec as dataset.${FIELD_OF[f.purpose]}.`));
      input.value = "";
    } catch (e) {
      status.replaceChildren(h("div", { class: "error-box", id: "upload-error" }, e.message));
    } finally {
      progress.hidden = true;
    }
    await reload();
  };
  app.append(h("h1", {}, "Files"),
    h("p", { class: "muted" }, "JSONL or Parquet. train / eval rows: {prompt, answer} or {prompt, answers: [...]}; ",
      "joint jobs may use {query, answers, gold_doc_id}. corpus rows: {id, text}. A file is checked row by row before it is accepted."),
    h("div", { class: "toolbar" }, input, purpose, h("button", { class: "primary", id: "upload-btn", onclick: send }, "Upload"), progress),
    status,
    h("table", {}, h("thead", {}, h("tr", {}, ["id", "purpose", "name", "format", "rows", "size", "uploaded", ""].map((c) => h("th", {}, c)))), tbody));
  await reload();
}
