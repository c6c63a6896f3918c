"""The dashboard in a real headless chromium against a running `grpo-jobs dev` with real jobs.

Screenshots land in test-artifacts/dashboard/."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.dashboard.conftest import SPARSE_JOB, sign_in
from tests.e2e.conftest import wait_job

# one service for the module (its fixtures): pytest-xdist runs the module's tests in one process
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dashboard")]
EXAMPLES = Path(__file__).parents[2] / "examples"


def chart(page, title: str):
    return page.locator(f'.chart[data-title="{title}"]')


def test_nothing_is_visible_without_a_key(page, service):
    page.goto(service.base + "/#/jobs")
    page.wait_for_selector("#api-key")
    assert page.locator("#jobs-table").count() == 0
    page.expected_errors.append("status of 401")  # the server's answer to a wrong key, shown to the user
    page.fill("#api-key", "not-a-key")
    page.click("button[type=submit]")
    page.wait_for_selector("#login-error:not([hidden])")
    assert "not valid" in page.inner_text("#login-error")
    page.shot("bad-key")
    page.fill("#api-key", service.key)
    page.click("button[type=submit]")
    page.wait_for_selector("#jobs-table tbody tr")
    page.click("#signout")
    page.wait_for_selector("#api-key")


def test_jobs_list_shows_every_job_and_filters(page, service):
    polls: list[int] = []  # the list's refreshes: with its validator, a 304 while nothing changed
    page.on("response", lambda r: polls.append(r.status) if "/v1/jobs?" in r.url else None)
    sign_in(page, service)
    api_ids = {j["id"] for j in service.client.get("/v1/jobs", params={"limit": 200}).json()["items"]}
    rows = page.locator("#jobs-table tbody tr")
    assert {int(x) for x in rows.evaluate_all("rs => rs.map(r => r.dataset.jobId)")} == api_ids
    sparse = service.jobs["sparse"]
    row = page.locator(f'tr[data-job-id="{sparse["id"]}"]')
    assert row.locator(".badge").inner_text() == "succeeded"
    assert f"{sparse['total_steps']} / {sparse['total_steps']}" in row.inner_text()
    latest = service.client.get(f"/v1/jobs/{sparse['id']}/metrics/latest").json()["reward/mean"]["value"]
    assert float(row.locator('[data-metric="reward/mean"]').inner_text()) == pytest.approx(latest, abs=1e-3)
    deadline = time.monotonic() + 15
    while 304 not in polls and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert 304 in polls and polls[0] == 200, polls
    page.select_option("#filter-kind", "tracin")
    page.wait_for_function("() => [...document.querySelectorAll('#jobs-table tbody tr')].length === 1")
    assert int(rows.first.get_attribute("data-job-id")) == service.jobs["tracin"]["id"]
    assert "kind=tracin" in page.url
    page.shot("filtered")


def test_job_page_draws_every_series_with_its_points(page, service):
    job = service.jobs["sparse"]
    sign_in(page, service)
    page.goto(f"{service.base}/#/jobs/{job['id']}")
    steps = job["total_steps"]
    page.wait_for_selector('.chart[data-title="Reward"] canvas')
    assert chart(page, "Reward").get_attribute("data-points") == str(service.points(job["id"], "reward/mean")) == str(steps)
    for title in ("Loss", "Evaluation (greedy, validation split)", "Step time (s): rollout vs training", "Gradient norm",
                  "Unchanged parameters (primary threshold)"):
        assert chart(page, title).locator("canvas").count() == 1, title
        assert int(chart(page, title).get_attribute("data-points")) >= 1, title
    evals = service.points(job["id"], "eval/accuracy")
    assert chart(page, "Evaluation (greedy, validation split)").get_attribute("data-points") == str(evals)
    # sparsity reports: threshold curve, magnitude vs random, layer x component heatmap
    page.wait_for_selector("#sparsity-summary")
    assert page.locator('#sparsity .chart[data-title="Unchanged fraction against threshold"] canvas').count() == 1
    assert page.locator('#sparsity .chart[data-title="Partial update: KL to the full update"] canvas').count() == 1
    assert page.locator("#sparsity table.heatmap tbody tr").count() >= 2
    curve = page.locator('#sparsity .chart[data-title="Unchanged fraction over training"]')  # steps 2 and 4
    assert (curve.get_attribute("data-points"), curve.get_attribute("data-series")) == (
        "2", "since the last report,since the start")
    # fp32 against bf16 at the literature's three tolerances, and KL on the task in the summary
    assert page.locator('#sparsity .chart[data-title^="Unchanged at the literature\'s tolerances"]').get_attribute("data-points") == "3"
    assert "KL(π₀ ‖ π) on the task" in page.locator("#sparsity-summary").inner_text()
    # samples of the last step, events, checkpoints
    page.wait_for_selector("#samples-body tr")
    n_samples = len(service.client.get(f"/v1/jobs/{job['id']}/samples", params={"step": steps}).json())
    assert page.locator("#samples-body tr").count() == n_samples > 0
    page.fill("#samples-step", "1")
    page.dispatch_event("#samples-step", "change")
    page.wait_for_function("() => [...document.querySelectorAll('#samples-body tr td:first-child')].every(td => td.textContent === '1')")
    page.wait_for_selector('#events [data-type="succeeded"]')  # the events load on their own request
    assert page.locator('#events [data-type="succeeded"]').count() == 1
    ckpts = service.client.get(f"/v1/jobs/{job['id']}/checkpoints").json()
    page.wait_for_function(f"() => document.querySelectorAll('#checkpoints-body tr').length === {len(ckpts)}")
    assert page.locator("#cancel-btn").count() == 0  # finished jobs cannot be cancelled
    # a badge per health guard, coloured as the API's summary says, the reason in its tooltip
    health = service.client.get(f"/v1/jobs/{job['id']}").json()["health"]
    assert page.locator("#health").get_attribute("data-level") == health["level"]
    for guard, flag in health["guards"].items():
        badge = page.locator(f'#health [data-guard="{guard}"]')
        assert badge.get_attribute("data-level") == (flag["level"] if flag else "ok"), guard
        if flag:
            assert badge.get_attribute("title") == flag["message"]
    # what ran: the fingerprint's hashes as the API serves them
    fp = service.client.get(f"/v1/jobs/{job['id']}").json()["fingerprint"]
    assert page.locator('#fingerprint [data-field="spec"]').inner_text() == fp["spec_sha256"]
    assert page.locator('#fingerprint [data-field="model weights"]').inner_text() == fp["model_sha256"]
    assert page.locator('#fingerprint [data-field="starting weights"]').inner_text() == fp["trainable_sha256"]
    page.shot("job")


def test_tracin_and_joint_panels(page, service):
    sign_in(page, service)
    t = service.jobs["tracin"]
    page.goto(f"{service.base}/#/jobs/{t['id']}")
    page.wait_for_selector('.chart[data-title="Selection ratio"] canvas')
    assert chart(page, "Selection ratio").get_attribute("data-points") == str(t["total_steps"])
    page.wait_for_selector("#selection-summary")
    sels = service.client.get(f"/v1/jobs/{t['id']}/selections", params={"scores": False}).json()
    bins = len(sels[-1]["histogram"]["counts"])
    assert page.locator("#selections .chart canvas").count() == 1
    assert page.locator("#selections .chart").get_attribute("data-points") == str(bins)
    page.select_option("#selection-step", "0")
    page.wait_for_function(f"() => document.querySelector('#selection-summary').textContent.startsWith('step {sels[0]['step']} ')")
    page.wait_for_selector("#samples-body tr")
    assert page.locator("#samples-body tr td:nth-child(6)").first.inner_text() != "–"  # influence recorded
    # the prediction check: one scatter point per checked step, and the correlations served by the API
    check = service.client.get(f"/v1/jobs/{t['id']}/tracin/prediction").json()
    assert check["points"], "no step was checked"
    page.wait_for_selector("#prediction .chart canvas")
    assert page.locator("#prediction .chart").get_attribute("data-points") == str(len(check["points"]))
    assert page.locator("#prediction-summary").inner_text().startswith(f"{len(check['points'])} step")
    page.shot("tracin")
    f = service.jobs["sft"]  # a supervised job: its header and its training and validation losses
    page.goto(f"{service.base}/#/jobs/{f['id']}")
    page.wait_for_selector('.chart[data-title="Loss"] canvas')
    assert chart(page, "Loss").get_attribute("data-series") == "loss/train,loss/val"
    assert "4 examples a step, lr 0.01" in page.locator("#job-header").inner_text()
    j = service.jobs["joint"]
    page.goto(f"{service.base}/#/jobs/{j['id']}")
    page.wait_for_selector('section[data-section="Retriever"] .chart canvas')
    for title in ("Retriever reward", "Retriever KL", "Retriever entropy", "Gold-document recall"):
        assert chart(page, title).get_attribute("data-points") == str(j["total_steps"]), title
    page.shot("joint")


def test_compare_overlays_a_metric_of_several_jobs(page, service):
    sign_in(page, service)
    ids = [service.jobs["sparse"]["id"], service.jobs["tracin"]["id"]]
    for i in ids:
        page.check(f'tr[data-job-id="{i}"] input[type=checkbox]')
    page.click("#compare-btn")
    page.wait_for_selector("#compare-chart canvas")
    assert page.locator("#compare-chart .chart").get_attribute("data-series").count("#") == 2
    page.select_option("#compare-metric", "loss/total")
    page.wait_for_function("() => document.querySelector('#compare-chart .chart')?.dataset.title === 'loss/total'")
    page.wait_for_selector("#compare-chart canvas")
    page.shot("compare")


@pytest.fixture(scope="module")
def long_job(service):
    """A job that runs until a test cancels it."""
    long = {**SPARSE_JOB, "name": "long-running", "grpo": {**SPARSE_JOB["grpo"], "steps": 400, "checkpoint_every": 0}}
    long.pop("sparsity")
    return service.submit(long)


def test_where_streams_cannot_stay_open_a_running_job_is_polled_for_new_steps_only(page, service, long_job):
    asked: list[str] = []
    page.route("**/stream?*", lambda route: route.abort())  # a proxy that lets no stream through
    page.on("request", lambda r: asked.append(r.url) if "/metrics?" in r.url else None)
    page.expected_errors = ["ERR_FAILED"]
    first = _reward_chart_grows(page, service, long_job)
    polls = [u for u in asked if "after_step=" in u]
    assert len(asked) - len(polls) == 1, asked  # the page's first load whole; after it, only later steps
    steps = [int(u.split("after_step=")[1].split("&")[0]) for u in polls]
    assert steps == sorted(steps) and steps[-1] >= first - 1, steps


def _reward_chart_grows(page, service, job) -> int:
    """Opens the job's page and waits until its reward chart has two more steps; the points it had at first."""
    sign_in(page, service)
    page.goto(f"{service.base}/#/jobs/{job['id']}")
    page.wait_for_selector('.chart[data-title="Reward"] canvas', timeout=120_000)
    first = int(chart(page, "Reward").get_attribute("data-points"))
    page.wait_for_function(f"() => Number(document.querySelector('.chart[data-title=\"Reward\"]').dataset.points) >= {first + 2}",
                           timeout=120_000)
    return first


def test_watch_a_running_job_then_cancel_it(page, service, long_job):
    job = long_job
    _reward_chart_grows(page, service, job)  # new steps arrive over the event stream without a reload
    assert page.locator("#job-header h1 .badge").inner_text() == "running"
    page.shot("running")
    page.click("#cancel-btn")
    page.wait_for_selector('#job-header .badge[data-status="cancelled"]', timeout=120_000)
    done = wait_job(service.client, job["id"], service.procs)
    assert done["status"] == "cancelled" and done["step"] < 400
    # the charts hold every recorded step
    page.wait_for_function(f"() => document.querySelector('.chart[data-title=\"Reward\"]').dataset.points === '{service.points(job['id'], 'reward/mean')}'")
    # and the events log gets the outcome (it arrives over the stream with or after the status)
    page.wait_for_selector('#events [data-type="cancelled"]', timeout=30_000)
    assert page.locator('#events [data-type="cancelled"]').count() == 1


def test_submit_shows_errors_next_to_fields_then_submits(page, service):
    sign_in(page, service)
    page.click('a[data-nav="submit"]')
    page.wait_for_selector("#spec-text")
    bad = "kind: grpo\nmodel:\n  name: tiny-random-llama\ngrpo:\n  steps: 2\n  num_generations: 1\n  learnin_rate: 0.1\n"
    page.fill("#spec-text", bad)
    page.click("#validate-btn")
    page.wait_for_selector("#spec-errors")
    err = page.locator('.field-error[data-field="grpo.num_generations"]')
    assert "greater than or equal to 2" in err.inner_text()
    # the error sits right under line 6, the line that names the field
    assert err.evaluate("e => e.previousElementSibling.dataset.line") == "6"
    assert page.locator('.field-error[data-field="grpo.learnin_rate"]').evaluate("e => e.previousElementSibling.dataset.line") == "7"
    before = len(service.client.get("/v1/jobs", params={"limit": 200}).json()["items"])
    page.click("#submit-btn")  # invalid: nothing is submitted
    page.wait_for_selector("#spec-errors")
    page.shot("errors")
    assert len(service.client.get("/v1/jobs", params={"limit": 200}).json()["items"]) == before
    # an uploaded spec file replaces the text and validates
    page.set_input_files("#spec-file", str(EXAMPLES / "tracin-minimal.yaml"))
    page.wait_for_function("() => document.querySelector('#spec-text').value.startsWith('# The smallest TracIn')")
    page.click("#validate-btn")
    page.wait_for_selector("#spec-ok")
    assert page.locator(".field-error").count() == 0
    # the rewards this deployment offers, with their parameters; "insert" writes an entry at the cursor
    assert "\nrubric = " in page.locator('#rewards-panel tr[data-reward="judge"]').inner_text()
    good = ("kind: grpo\nname: from-the-browser\nmodel: {name: tiny-random-llama, lora: {r: 4}}\n"
            "grpo: {steps: 2, max_new_tokens: 4, eval_prompts: 2}\nrewards:\n")
    page.fill("#spec-text", good)
    page.evaluate("() => { const t = document.querySelector('#spec-text'); t.selectionStart = t.value.length; }")
    page.click('#rewards-panel tr[data-reward="token_f1"] .insert-reward')
    assert page.input_value("#spec-text").endswith("rewards:\n  - {name: token_f1, weight: 1.0}\n")
    page.click("#submit-btn")
    page.wait_for_url("**/#/jobs/*")
    job_id = int(page.url.rsplit("/", 1)[1])
    submitted = service.client.get(f"/v1/jobs/{job_id}").json()
    assert submitted["name"] == "from-the-browser" and submitted["spec"]["rewards"][0]["name"] == "token_f1"
    page.wait_for_selector("#job-header")
    wait_job(service.client, job_id, service.procs)


def test_a_100k_step_job_is_drawn_from_server_buckets(page, service):
    """A long job's charts get at most 1000 bucketed points (with a min..max band), and a drag-zoom
    refetches the selected range at full resolution."""
    from service.store import jobs as jobs_q
    from service.store import metrics as metrics_q
    from service.store.db import session_scope

    n = 100_000
    with session_scope(service.store_url) as s:
        job, _ = jobs_q.create_job(s, owner="local", kind="grpo", spec={"kind": "grpo"}, name="imported-100k",
                                   total_steps=n)
        job.status, job.step = "succeeded", n  # recorded elsewhere: never queued here
        s.flush()
        jid = job.id
        rows = [(jid, k, step, (step % 997) / 997 + (5.0 if step == 54_321 else 0.0))
                for k in ("reward/mean", "loss/total") for step in range(1, n + 1)]
        metrics_q.upsert_points(s, rows=rows)
    sign_in(page, service)
    page.goto(f"{service.base}/#/jobs/{jid}")
    page.wait_for_selector('.chart[data-title="Reward"] canvas')
    api_points = service.points(jid, "reward/mean")
    assert api_points <= 1000 and chart(page, "Reward").get_attribute("data-points") == str(api_points)
    # the spike survives bucketing as the band's top
    top = page.evaluate("() => Math.max(...document.querySelector('.chart[data-title=\"Loss\"]').__chart.u.data.at(-2).filter(v => v !== null))")
    assert top == pytest.approx(5.0 + (54_321 % 997) / 997)
    # drag-zoom into under 1000 steps: the chart refetches them one point per step
    box = chart(page, "Reward").locator(".u-over").bounding_box()
    x0 = box["x"] + box["width"] * 0.500
    x1 = x0 + min(0.009 * box["width"], 5)
    page.mouse.move(x0, box["y"] + 20)
    page.mouse.down()
    page.mouse.move(x1, box["y"] + 20, steps=4)
    page.mouse.up()
    page.wait_for_function("() => { const x = document.querySelector('.chart[data-title=\"Reward\"]').__chart.u.data[0];"
                           " return x.length >= 100 && x.length <= 1000 && x[1] - x[0] === 1; }")
    page.shot("zoomed")
    page.locator('.chart[data-title="Reward"] .u-over').dblclick()
    page.wait_for_function(f"() => document.querySelector('.chart[data-title=\"Reward\"]').dataset.points === '{api_points}'")


def test_files_upload_insert_delete_and_checkpoint_download(page, service, tmp_path):
    import json
    import tarfile

    sign_in(page, service)
    page.click('a[data-nav="files"]')
    page.wait_for_selector("#files-body")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    page.expected_errors.append("status of 422")
    page.set_input_files("#file-input", str(bad))
    page.click("#upload-btn")
    assert "line 2: needs an 'answer'" in page.locator("#upload-error").inner_text()
    good = tmp_path / "sums.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(50)))
    page.set_input_files("#file-input", str(good))
    page.select_option("#file-purpose", "train")
    page.click("#upload-btn")
    page.wait_for_selector("#upload-ok")
    file_id = page.locator("#upload-ok code").inner_text()
    assert service.client.get(f"/v1/files/{file_id}").json()["rows"] == 50
    page.wait_for_selector(f'#files-body tr[data-file="{file_id}"]')
    page.shot("files")
    # the submit page offers it; "insert" writes its id at the cursor
    page.click('a[data-nav="submit"]')
    page.wait_for_selector(f'#files-panel tr[data-file="{file_id}"]')
    page.fill("#spec-text", "kind: grpo\ndataset: {name: file, train_file: ")
    page.evaluate("() => { const t = document.querySelector('#spec-text'); t.selectionStart = t.value.length; }")
    page.click(f'#files-panel tr[data-file="{file_id}"] .insert-file')
    assert page.input_value("#spec-text").endswith(f"train_file: {file_id}")
    # delete it from the Files page
    page.click('a[data-nav="files"]')
    page.on("dialog", lambda d: d.accept())
    page.click(f'#files-body tr[data-file="{file_id}"] .delete-file')
    page.wait_for_selector(f'#files-body tr[data-file="{file_id}"]', state="detached")
    assert service.client.get(f"/v1/files/{file_id}").status_code == 404
    # a checkpoint's download button saves the archive
    job = service.jobs["sparse"]
    page.goto(f"{service.base}/#/jobs/{job['id']}")
    page.wait_for_selector("#checkpoints-body .download-ckpt")
    step = page.locator("#checkpoints-body .download-ckpt").last.get_attribute("data-step")
    with page.expect_download() as info:
        page.locator("#checkpoints-body .download-ckpt").last.click()
    saved = tmp_path / "ckpt.tar.gz"
    info.value.save_as(saved)
    assert info.value.suggested_filename == f"job-{job['id']}-step-{step}.tar.gz"
    with tarfile.open(saved) as tar:
        assert f"job-{job['id']}-step-{step}/adapter_model.safetensors" in tar.getnames()


def test_an_agent_jobs_samples_show_each_episode_turn_by_turn(page, service):
    job = service.jobs["agent"]
    sign_in(page, service)
    page.goto(f"{service.base}/#/jobs/{job['id']}")
    page.wait_for_selector("#samples-body tr td.episode")
    samples = service.client.get(f"/v1/jobs/{job['id']}/samples", params={"step": job["total_steps"]}).json()
    first = samples[0]["extra"]["episode"]
    cell = page.locator("#samples-body tr td.episode").first
    assert cell.locator(".turn").count() == len(first["turns"]) > 0
    assert first["turns"][0]["observation"] in cell.locator(".turn .env").first.inner_text()
    assert f"{first['tokens']['sampled']} sampled" in cell.inner_text()
    page.wait_for_selector('.chart[data-title="Reward"] canvas')
    page.shot("agent")


def test_a_multi_node_jobs_page_names_the_worker_of_each_node(page, service):
    """A job that ran on two machines (recorded as its workers would: `dev` runs one machine's jobs), seen by
    `dev`'s key, the operator's."""
    from service.core.specs import parse_spec
    from service.store import leases
    from service.store import nodes as nodes_q

    spec = parse_spec({**SPARSE_JOB, "name": "two-machines", "resources": {"nodes": 2}})
    job = leases.submit_job(service.store_url, owner="local", spec=spec).job
    lease = leases.acquire_lease(service.store_url, job_id=job.id, holder="gpu-a:11:x", lease_timeout_s=60)
    for node, machine in ((0, "gpu-a"), (1, "gpu-b")):
        nodes_q.join(service.store_url, job_id=job.id, uid=lease.uid, attempt=lease.attempt, head="gpu-a:11:x",
                     node=node, node_name=machine, holder=f"{machine}:{11 + node}:x")
    leases.finish_job(service.store_url, job_id=job.id, holder="gpu-a:11:x", status="cancelled", message="by hand")
    sign_in(page, service)
    page.goto(f"{service.base}/#/jobs/{job.id}")
    page.wait_for_selector('#nodes [data-node="1"]')
    assert page.locator("#nodes").inner_text().splitlines() == ["node 0: gpu-a (gpu-a:11:x, attempt 1)",
                                                                "node 1: gpu-b (gpu-b:12:x, attempt 1)"]
    # the events load on their own request, after the nodes' panel may already show
    page.locator("#events").get_by_text("node 1 of 2 (attempt 1) taken by a worker").wait_for(timeout=30_000)
