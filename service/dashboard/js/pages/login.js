// Sign in with an API key (`grpo-jobs keys create --owner NAME`; `grpo-jobs dev` prints one).
import { api, auth } from "../api.js";
import { h } from "../dom.js";

export async function loginPage({ app }) {
  const input = h("input", { type: "password", id: "api-key", placeholder: "API key", autocomplete: "off" });
  const error = h("div", { class: "error-box", hidden: true, id: "login-error" });
  const submit = async (ev) => {
    ev.preventDefault();
    const key = input.value.trim();
    if (!key) return;
    try {
      await api("/v1/jobs?limit=1", { key });
      auth.set(key);
      location.hash = "#/jobs";
    } catch (err) {
      error.hidden = false;
      error.textContent = err.status === 401 ? "That API key is not valid." : `Could not sign in: ${err.message}`;
    }
  };
  app.append(h("form", { class: "card login", onsubmit: submit },
    h("h1", {}, "Sign in"),
    h("p", { class: "muted" }, "Paste an API key. Create one with ", h("code", {}, "grpo-jobs keys create --owner NAME"),
      "; ", h("code", {}, "grpo-jobs dev"), " prints one for the local owner."),
    input, error, h("button", { class: "primary", type: "submit" }, "Sign in")));
  input.focus();
}
