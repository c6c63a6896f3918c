// A running job's updates, as one source of callbacks: its server-sent-events stream, opened from the last
// step and event the page has. A dropped stream (an API restart, a proxy's idle timeout, an expired stream
// token) is reopened from there, never from the start. Where streams keep failing (a proxy that buffers
// them), the page polls instead: the job, then only the metric steps after the last one it has
// (`after_step`) and the events after the last one (`after_id`), each with the last answer's ETag, so a poll
// of a job that has not moved is a bodiless 304.
import { api, metrics, streamJob } from "./api.js";
import { TERMINAL } from "./dom.js";

const RETRY_MS = 2000;
const POLL_MS = 2000;
const STREAM_TRIES = 3; // failures in a row without a message before polling instead

// on: { status(s), metrics(step, values), event(ev), end() }; returns stop().
export function follow(id, { lastStep, on }) {
  let step = lastStep, eventId = 0, failures = 0, stopped = false, es = null, timer = null;
  const seenStep = (s, values) => { if (s > step) { step = s; on.metrics(s, values); } };
  const seenEvent = (ev) => { if (ev.id > eventId) { eventId = ev.id; on.event(ev); } };
  const later = (fn, ms) => { if (!stopped) timer = setTimeout(fn, ms); };

  async function stream() {
    try {
      es = await streamJob(id, { from_step: step });
    } catch {
      return failed();
    }
    es.addEventListener("status", (e) => { failures = 0; on.status(JSON.parse(e.data)); });
    es.addEventListener("metrics", (e) => { const m = JSON.parse(e.data); seenStep(m.step, m.metrics); });
    es.addEventListener("event", (e) => seenEvent(JSON.parse(e.data)));
    es.addEventListener("end", () => { es.close(); stopped = true; on.end(); });
    // EventSource would reopen the same URL (the first step, a token that may have expired): reopen ours
    es.onerror = () => { es.close(); failed(); };
  }

  function failed() {
    failures += 1;
    if (failures < STREAM_TRIES) later(stream, RETRY_MS * failures);
    else later(poll, 0);
  }

  async function poll() {
    try {
      const job = await api(`/v1/jobs/${id}`);
      on.status(job);
      const body = await metrics(id, { afterStep: step });
      const byStep = new Map();
      for (const s of body.series) for (const p of s.points) {
        if (!byStep.has(p.step)) byStep.set(p.step, {});
        byStep.get(p.step)[s.key] = p.value;
      }
      [...byStep.keys()].sort((a, b) => a - b).forEach((s) => seenStep(s, byStep.get(s)));
      (await api(`/v1/jobs/${id}/events?after_id=${eventId}`)).forEach(seenEvent);
      if (TERMINAL.has(job.status)) { stopped = true; return on.end(); }
    } catch { /* the API is away: the next poll asks again */ }
    later(poll, POLL_MS);
  }

  stream();
  return () => { stopped = true; clearTimeout(timer); es?.close(); };
}
