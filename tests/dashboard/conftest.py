"""A real `grpo-jobs dev` service with real (tiny) finished jobs, and a headless Debian chromium driven by Playwright."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import CI
from tests.e2e.conftest import TINY_JOB, Procs, embedded_env, free_port, wait_http, wait_job

CHROMIUM = os.environ.get("GRPO_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).parents[2] / "test-artifacts" / "dashboard"

# One-digit answers: a random tiny model's last digit is right often enough to give rewards spread,
# so advantages, influence scores and parameter updates are all non-trivial.
DIGITS = [{"prompt": f"Say the digit after {d}.", "answer": str((d + 1) % 10)} for d in range(10)] * 4
DIGIT_DATA = {"name": "jsonl", "path": "digits.jsonl", "num_val": 8}
DIGIT_REWARD = [{"name": "numeric_match"}]  # the completion's last number; jsonl's default is exact_match
SPARSE_JOB = {**TINY_JOB, "name": "grpo-sparsity", "dataset": DIGIT_DATA, "rewards": DIGIT_REWARD,
              "grpo": {**TINY_JOB["grpo"], "steps": 4, "learning_rate": 1e-2},
              "sparsity": {"measure_interval": 2, "quality": {"enabled": True, "probe_size": 2}}}
TRACIN_JOB = {"kind": "tracin", "name": "tracin-tiny", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
              "dataset": DIGIT_DATA, "rewards": DIGIT_REWARD,
              "grpo": {"steps": 5, "prompts_per_step": 4, "num_generations": 4, "max_new_tokens": 8, "eval_prompts": 2,
                       "learning_rate": 1e-2},
              "tracin": {"val_prompts": 4, "val_generations": 4}}
SFT_JOB = {"kind": "sft", "name": "sft-tiny", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
           "dataset": DIGIT_DATA, "sft": {"steps": 3, "batch_size": 4, "max_new_tokens": 8, "eval_prompts": 2,
                                          "learning_rate": 1e-2}}
JOINT_JOB = {"kind": "joint", "name": "joint-tiny", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
             "retriever": {"name": "tiny-random-bert", "k": 2, "candidates": 4},
             "dataset": {"name": "persona-facts", "corpus_size": 12, "num_val": 4},
             "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 6, "eval_prompts": 2}}

AGENT_JOB = {"kind": "grpo", "name": "agent-tiny", "model": {"name": "tiny-random-llama", "lora": {"r": 4}},
             "environment": {"name": "guess-number", "max_turns": 2, "max_episode_tokens": 192,
                             "max_observation_tokens": 48, "eval_episodes": 2},
             "grpo": {"steps": 2, "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 8}}


def _need(reason: str):
    if CI:
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


# Module-scoped, not session-scoped: the browser, and the service beside it, end with the dashboard's module.
# Playwright's sync API keeps an event loop running on the thread that started it until it stops, and every
# later test in the same process that calls asyncio.run() failed ("cannot be called from a running event loop").
@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright is not installed (pip install -e '.[dev]')")
    if not Path(CHROMIUM).exists():
        _need(f"no chromium at {CHROMIUM} (apt-get install chromium, or set GRPO_CHROMIUM)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


class Service:
    def __init__(self, base: str, key: str, procs: Procs, store_url: str) -> None:
        self.base, self.key, self.procs, self.store_url = base, key, procs, store_url
        self.client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        self.jobs: dict[str, dict] = {}

    def submit(self, spec: dict) -> dict:
        r = self.client.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return r.json()

    def points(self, job_id: int, key: str) -> int:
        body = self.client.get(f"/v1/jobs/{job_id}/metrics", params={"keys": key}).json()
        return len(body["series"][0]["points"])


@pytest.fixture(scope="module")
def service(tmp_path_factory, models_root):
    tmp = tmp_path_factory.mktemp("dashboard")
    procs = Procs(embedded_env(tmp / "data", models_root), tmp)
    (tmp / "data" / "datasets" / "local").mkdir(parents=True)  # the folder of `dev`'s owner, 'local'
    (tmp / "data" / "datasets" / "local" / "digits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DIGITS))
    port = free_port()
    procs.start("dev", "dev", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", procs)
        key_file = tmp / "data" / "dev-api-key"
        for _ in range(100):
            if key_file.exists():
                break
            time.sleep(0.1)
        from service.core.settings import Settings

        store_url = Settings(GRPO_DATA_DIR=tmp / "data").store_url
        svc = Service(base, key_file.read_text().strip(), procs, store_url)
        for name, spec in (("sparse", SPARSE_JOB), ("tracin", TRACIN_JOB), ("joint", JOINT_JOB), ("sft", SFT_JOB),
                           ("agent", AGENT_JOB)):
            svc.jobs[name] = svc.submit(spec)
        for name, job in svc.jobs.items():
            svc.jobs[name] = done = wait_job(svc.client, job["id"], procs)
            assert done["status"] == "succeeded", (done, procs.logs())
        yield svc
    finally:
        procs.stop()


@pytest.fixture
def page(browser, service, request):
    """A fresh browser context per test; fails the test on any console error or page error."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.expected_errors = []  # substrings a test expects, e.g. the 401 of a wrong key
    pg.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    pg.set_default_timeout(20_000)
    pg.shot = lambda name: pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}-{name}.png"), full_page=True)
    yield pg
    pg.shot("end")
    ctx.close()
    assert not [e for e in errors if not any(x in e for x in pg.expected_errors)], errors


def sign_in(page, service) -> None:
    page.goto(service.base + "/#/login")
    page.fill("#api-key", service.key)
    page.click("button[type=submit]")
    page.wait_for_selector("#jobs-table tbody tr")
