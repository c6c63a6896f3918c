// The API client: every request carries the signed-in API key; a 401 sends the user back to sign-in.

const KEY = "grpo-jobs.api-key";

export const auth = {
  get key() { return localStorage.getItem(KEY); },
  set(key) { localStorage.setItem(KEY, key); },
  clear() { localStorage.removeItem(KEY); },
};

export class ApiError extends Error {
  constructor(status, body) {
    super(body?.message || (typeof body?.detail === "string" ? body.detail : `HTTP ${status}`));
    this.status = status;
    this.body = body;
  }
}

// The last answer to each GET and its validator: a poll sends it back (If-None-Match), and a 304 (nothing
// changed) costs the server no read of the records and reuses the answer here.
const seen = new Map();
const SEEN_MAX = 200;

export async function api(path, { method = "GET", json, text, contentType, headers = {}, key } = {}) {
  const h = { Authorization: `Bearer ${key || auth.key}`, ...headers };
  const cached = method === "GET" && !key ? seen.get(path) : undefined;
  if (cached) h["If-None-Match"] = cached.etag;
  let body;
  if (json !== undefined) { body = JSON.stringify(json); h["Content-Type"] = "application/json"; }
  if (text !== undefined) { body = text; h["Content-Type"] = contentType || "application/yaml"; }
  const r = await fetch(path, { method, headers: h, body, cache: "no-store" });
  if (r.status === 304 && cached) return structuredClone(cached.data);
  const data = r.headers.get("content-type")?.includes("json") ? await r.json() : await r.text();
  const etag = r.headers.get("etag");
  if (r.ok && method === "GET" && !key && etag) {
    seen.delete(path);  // re-inserted last: the oldest goes first when full
    seen.set(path, { etag, data: structuredClone(data) });
    if (seen.size > SEEN_MAX) seen.delete(seen.keys().next().value);
  }
  if (r.status === 401 && !key) {
    auth.clear();
    location.hash = "#/login";
  }
  if (!r.ok) throw new ApiError(r.status, data);
  return data;
}

export const qs = (params) => {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") p.set(k, v);
  const s = p.toString();
  return s ? `?${s}` : "";
};

// EventSource cannot send headers, and a key in a URL ends up in logs: the stream is opened
// with a short-lived token for this one job, asked for with the key in a header.
export async function streamJob(jobId, params = {}) {
  const { token } = await api(`/v1/jobs/${jobId}/stream-token`, { method: "POST" });
  return new EventSource(`/v1/jobs/${jobId}/stream` + qs({ ...params, access_token: token }));
}

export async function metrics(jobId, { keys, fromStep, afterStep, toStep, maxPoints = 1000 } = {}) {
  return api(`/v1/jobs/${jobId}/metrics` + qs({
    keys: keys?.join(","), from_step: fromStep, after_step: afterStep, to_step: toStep, max_points: maxPoints,
  }));
}
