// Hash router: #/login, #/jobs, #/jobs/ID, #/compare?ids=1,2&metric=reward/mean, #/submit, #/files.
import { auth } from "./api.js";
import { clear } from "./dom.js";
import { comparePage } from "./pages/compare.js";
import { filesPage } from "./pages/files.js";
import { jobPage } from "./pages/job.js";
import { jobsPage } from "./pages/jobs.js";
import { loginPage } from "./pages/login.js";
import { submitPage } from "./pages/submit.js";

const app = document.getElementById("app");
let teardown = null; // the current page's cleanup: timers, event streams

function parse() {
  const [path, query = ""] = location.hash.replace(/^#/, "").split("?");
  return { parts: path.split("/").filter(Boolean), query: new URLSearchParams(query) };
}

async function route() {
  teardown?.();
  teardown = null;
  clear(app);
  const { parts, query } = parse();
  const signedIn = !!auth.key;
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("signout").hidden = !signedIn;
  if (!signedIn && parts[0] !== "login") { location.hash = "#/login"; return; }
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active", a.dataset.nav === (parts[0] || "jobs")));
  const ctx = { app, query, onLeave: (fn) => { const prev = teardown; teardown = () => { prev?.(); fn(); }; } };
  try {
    if (parts[0] === "login") await loginPage(ctx);
    else if (parts[0] === "jobs" && parts[1]) await jobPage(ctx, Number(parts[1]));
    else if (parts[0] === "compare") await comparePage(ctx);
    else if (parts[0] === "submit") await submitPage(ctx);
    else if (parts[0] === "files") await filesPage(ctx);
    else await jobsPage(ctx);
  } catch (err) {
    if (err.status !== 401) {
      app.append(Object.assign(document.createElement("div"), { className: "error-box", textContent: err.message }));
    }
  }
}

document.getElementById("signout").addEventListener("click", () => { auth.clear(); location.hash = "#/login"; });
window.addEventListener("hashchange", route);
route();
