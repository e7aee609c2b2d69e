"""The dashboard in a real browser: Playwright drives Debian's Chromium against a live server, a
real Celery worker and the tiny model. One job trains for real (its variance diagnostic first,
scored by a scripted endpoint grader); the test logs in, reads the jobs list, watches the job
page update itself until the job succeeds, counts the points of every chart, pauses and resumes
a second job with the buttons (the keyboard for one of them), browses and opens a rollout, and
opens the variance report and a sample's runs from its chart. Every page is checked for labels,
keyboard-reachable actions and text contrast. Screenshots go to tests/output/dashboard/."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import jsonl, live_server
from tests.diagnostics.scripted_grader import scripted_grader, scripted_rows
from tests.rl.tool_server import tool_server
from tests.test_training_e2e import celery_worker, training_settings  # noqa: F401 - a fixture

CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parents[1] / "output" / "dashboard"
KINDS = ["always0", "always1", "mixed"] * 2  # what the scripted grader scores each row
TINY = {"lora_rank": 4, "max_tokens_per_turn": 12, "max_tokens_per_rollout": 24}

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() and not os.environ.get("CI"),
    reason="Debian's chromium is not installed (scripts/test.sh installs it; CI always runs this test)",
)

# WCAG 2.1 contrast of every visible text element outside the charts' SVG; disabled controls
# are exempt (WCAG 1.4.3), large text needs 3:1, the rest 4.5:1.
CONTRAST_JS = """() => {
  const parse = (c) => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(',').map(s => parseFloat(s)); return {r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1}; };
  const lum = (c) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(c.r) + 0.7152 * f(c.g) + 0.0722 * f(c.b); };
  const background = (el) => { for (let n = el; n; n = n.parentElement) {
      const c = parse(getComputedStyle(n).backgroundColor); if (c && c.a > 0.5) return c; }
    return {r: 255, g: 255, b: 255, a: 1}; };
  const bad = []; let checked = 0;
  for (const el of document.querySelectorAll('body *')) {
    if (el.closest('svg') || el.closest('.skip-link') || el.disabled || el.closest('[disabled]')) continue;
    const text = [...el.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent.trim()).join('');
    if (!text) continue;
    const style = getComputedStyle(el); const rect = el.getBoundingClientRect();
    if (style.visibility === 'hidden' || style.display === 'none' || rect.width === 0 || rect.height === 0) continue;
    const fg = parse(style.color), bg = background(el);
    const l1 = lum(fg), l2 = lum(bg); const ratio = (Math.max(l1, l2) + 0.05) / (Math.min(l1, l2) + 0.05);
    const size = parseFloat(style.fontSize), bold = parseInt(style.fontWeight) >= 700;
    const needed = (size >= 24 || (bold && size >= 18.66)) ? 3 : 4.5;
    checked++;
    if (ratio < needed) bad.push(`${el.tagName}.${el.className} "${text.slice(0, 30)}" ${ratio.toFixed(2)}`);
  }
  return {checked, bad};
}"""

# Every form control has a label; every button and link has a name and takes keyboard focus.
LABELS_JS = """() => {
  const problems = [];
  for (const el of document.querySelectorAll('input:not([type=hidden]), select, textarea')) {
    if (!(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !el.getAttribute('aria-labelledby'))
      problems.push(`unlabelled ${el.tagName} ${el.name || el.id}`);
  }
  for (const el of document.querySelectorAll('main button, main a[href], header button, header a[href]')) {
    if (el.closest('.modebar')) continue;
    const name = (el.getAttribute('aria-label') || el.textContent || '').trim();
    if (!name) problems.push(`nameless ${el.tagName} ${el.outerHTML.slice(0, 60)}`);
    if (el.disabled) continue;
    el.focus();
    if (document.activeElement !== el) problems.push(`not focusable: ${el.tagName} "${name.slice(0, 30)}"`);
  }
  return problems;
}"""

POINTS_JS = """() => Object.fromEntries([...document.querySelectorAll('.plot')].filter(n => n.data)
  .map(n => [n.id.replace('chart-', ''), n.data.map(t => [t.name, t.x.length])]))"""


def method(grader_url: str, tool_url: str, **x_open_model: Any) -> dict[str, Any]:
    return {"type": "reinforcement", "reinforcement": {
        "grader": {"type": "endpoint", "name": "scripted", "url": grader_url},
        "tools": [{"name": "search", "server_url": tool_url, "headers": {"Authorization": "Bearer tool-token-abcdef987654"}}],
        "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "n_epochs": 1, "eval_interval": 1,
                            "eval_samples": 2},
        "max_episode_steps": 2,
        "x_open_model": {**TINY, **x_open_model},
    }}


def check_accessibility(page: Any, name: str) -> None:
    problems = page.evaluate(LABELS_JS)
    assert not problems, (name, problems)
    contrast = page.evaluate(CONTRAST_JS)
    assert contrast["checked"] > 5 and not contrast["bad"], (name, contrast["bad"])
    page.evaluate("() => document.activeElement && document.activeElement.blur()")


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(OUTPUT / f"{name}.png"), full_page=True)


def status_text(page: Any) -> str:
    return page.locator('h1 + [data-field="status"], .title-row [data-field="status"]').first.inner_text()


@pytest.mark.timeout(900)
def test_the_dashboard_in_chromium(training_settings, project):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    OUTPUT.mkdir(parents=True, exist_ok=True)
    training_settings.dashboard_poll_s = 1.0
    with live_server(training_settings) as base, tool_server() as (tool_url, _), \
            scripted_grader() as (grader_url, _script), \
            openai.OpenAI(base_url=f"{base}/v1", api_key=project["key"], max_retries=0) as sdk, \
            celery_worker(training_settings, base) as (_, log), sync_playwright() as playwright:
        rows = io.BytesIO(jsonl(scripted_rows(KINDS)))
        training = sdk.files.create(file=("train.jsonl", rows), purpose="fine-tune")
        trained = sdk.fine_tuning.jobs.create(model="tiny-smollm2", training_file=training.id, seed=5, suffix="browser",
                                              method=method(grader_url, tool_url, diagnostic={"runs_per_sample": 2}))
        # The worker runs one task at a time: this one waits in the queue behind the first.
        waiting = sdk.fine_tuning.jobs.create(model="tiny-smollm2", training_file=training.id, seed=6,
                                              method=method(grader_url, tool_url))

        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        page.on("console", lambda msg: page_errors.append(msg.text) if msg.type == "error" else None)
        page.set_default_timeout(30_000)

        # Log in.
        page.goto(f"{base}/dashboard/jobs")
        assert page.url.startswith(f"{base}/dashboard/login")
        check_accessibility(page, "login")
        shot(page, "01-login")
        page.get_by_label("API key").fill(project["key"])
        page.keyboard.press("Enter")
        page.wait_for_url(f"{base}/dashboard/jobs")

        # The jobs list: both jobs, newest first.
        table = page.locator("#jobs-table tbody tr")
        expect(table).to_have_count(2)
        assert table.nth(0).get_attribute("data-job-id") == waiting.id
        assert table.nth(1).get_attribute("data-job-id") == trained.id
        expect(table.nth(1)).to_contain_text("tiny-smollm2")
        expect(table.nth(1)).to_contain_text("browser")
        check_accessibility(page, "jobs")
        shot(page, "02-jobs")

        # Pause and resume the waiting job with its buttons; the first by keyboard alone.
        page.locator(f'a[href="/dashboard/jobs/{waiting.id}"]').click()
        expect(page.locator("#action-pause")).to_be_enabled(timeout=60_000)  # queued once its file is validated
        check_accessibility(page, "job (queued)")
        page.locator("body").focus()
        for _ in range(40):
            page.keyboard.press("Tab")
            if page.evaluate("() => document.activeElement.id") == "action-pause":
                break
        else:
            raise AssertionError("the Pause button cannot be reached with the Tab key")
        page.keyboard.press("Enter")
        page.wait_for_url(f"**/dashboard/jobs/{waiting.id}?notice=paused")
        expect(page.locator('.title-row [data-field="status"]')).to_have_text("paused")
        expect(page.locator("#notice")).to_contain_text("Job paused")
        expect(page.locator("#action-resume")).to_be_enabled()
        expect(page.locator("#action-pause")).to_be_disabled()
        shot(page, "03-job-paused")
        page.locator("#action-resume").click()
        page.wait_for_url(f"**/dashboard/jobs/{waiting.id}?notice=resumed")
        assert status_text(page) in ("queued", "running")
        assert sdk.fine_tuning.jobs.retrieve(waiting.id).status in ("queued", "running")
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator("#action-cancel").click()
        page.wait_for_url(f"**/dashboard/jobs/{waiting.id}?notice=cancelled")
        expect(page.locator('.title-row [data-field="status"]')).to_have_text("cancelled")
        assert sdk.fine_tuning.jobs.retrieve(waiting.id).status == "cancelled"

        # The trained job's page follows the run by itself, without a reload, until it succeeds.
        page.goto(f"{base}/dashboard/jobs/{trained.id}")
        page.evaluate("() => { window.stillTheSamePage = true; }")
        page.wait_for_function("() => document.body.dataset.jobStatus === 'succeeded'", timeout=420_000)
        assert page.evaluate("() => window.stillTheSamePage") is True
        assert sdk.fine_tuning.jobs.retrieve(trained.id).status == "succeeded", log.read_text()[-3000:]
        expect(page.locator('.title-row [data-field="status"]')).to_have_text("succeeded")
        expect(page.locator('[data-field="progress"]')).to_have_text("3 / 3")

        # Every series has one point per reported step (validation: one per eval step).
        events = list(sdk.fine_tuning.jobs.list_events(trained.id, limit=100))
        metrics = [e.data for e in events if e.type == "metrics"]
        steps = len(metrics)
        evals = sum(1 for m in metrics if "valid_reward_mean" in m["scores"])
        assert steps == 3 and evals == 3
        points = page.evaluate(POINTS_JS)
        drawn = {"reward", "tool-calls", "tokens", "rollout-latency", "episode-failures", "zero-std", "loss",
                 "step-time"}
        assert drawn <= set(points), points  # the tiny model calls no tools: the per-tool charts stay empty
        for chart, series in points.items():
            for name, count in series:
                expected = evals if name.startswith("validation") else steps
                assert count == expected, (chart, name, count, expected)
        assert dict(points["reward"]) == {"train": steps, "validation": evals}
        rewards = [m["scores"]["train_reward_mean"] for m in sorted(metrics, key=lambda m: m["step"])]
        drawn_rewards = page.evaluate("() => document.getElementById('chart-reward').data[0].y")
        assert drawn_rewards == pytest.approx(rewards)
        expect(page.locator("#checkpoints-table tbody tr")).not_to_have_count(0)
        expect(page.locator("#events-list")).to_contain_text("The job has successfully completed")
        expect(page.locator("#tools-table")).to_contain_text("****7654")
        assert "tool-token-abcdef987654" not in page.content()
        check_accessibility(page, "job (succeeded)")
        shot(page, "04-job-succeeded")

        # The rollout browser: step 1's training rollouts (2 prompts x 2 rollouts), then one transcript.
        page.get_by_role("link", name="Browse rollouts").click()
        page.get_by_label("Step", exact=True).fill("1")
        page.get_by_label("Split", exact=True).select_option("train")
        page.get_by_role("button", name="Apply filters").click()
        rollout_rows = page.locator("#rollouts-table tbody tr")
        expect(rollout_rows).to_have_count(4)
        check_accessibility(page, "rollouts")
        shot(page, "05-rollouts")
        first = rollout_rows.first.locator("th a")
        trace_id = first.inner_text()
        first.click()
        expect(page.locator("#trace-id")).to_have_text(trace_id)
        assert trace_id.startswith("trace_")
        expect(page.locator("#transcript > li").first).to_contain_text("what was revenue in 20")
        expect(page.locator("#transcript")).to_contain_text("assistant · turn 1")
        expect(page.locator("#grader-errors")).to_be_visible()
        check_accessibility(page, "transcript")
        shot(page, "06-transcript")

        # The variance report of the diagnostic the job ran first.
        page.goto(f"{base}/dashboard/jobs/{trained.id}")
        page.get_by_role("link", name="Variance report").click()
        expect(page.locator("#verdict-message")).to_contain_text("33% of samples have signal")
        page.wait_for_function("() => document.getElementById('chart-samples').data !== undefined")
        classes = page.evaluate("""() => Object.fromEntries(document.getElementById('chart-samples').data
            .filter(t => t.meta !== 'runs').map(t => [t.meta, t.x.length]))""")
        assert classes == {"mixed": 2, "always_0": 2, "always_1": 2}
        means = page.evaluate("""() => document.getElementById('chart-samples').data
            .filter(t => t.meta !== 'runs').flatMap(t => t.x.map((x, i) => [x, t.y[i]])).sort((a, b) => a[0] - b[0])
            .map(p => p[1])""")
        assert means == sorted(means) and means[0] == 0 and means[-1] == 1
        runs = page.evaluate("() => document.getElementById('chart-samples').data.find(t => t.meta === 'runs').x.length")
        assert runs == 12
        expect(page.locator("#samples-table tbody tr")).to_have_count(6)
        check_accessibility(page, "variance")
        shot(page, "07-variance")
        # Click a mixed sample's marker in the chart: its runs open.
        target = page.evaluate("""() => {
            const gd = document.getElementById('chart-samples'); const trace = gd.data.find(t => t.meta === 'mixed');
            const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, box = gd.getBoundingClientRect();
            return {x: box.left + xa._offset + xa.l2p(trace.x[0]), y: box.top + ya._offset + ya.l2p(trace.y[0]),
                    sample: trace.customdata[0]};
        }""")
        page.mouse.move(target["x"], target["y"])
        page.mouse.click(target["x"], target["y"])
        page.wait_for_url(f"**/rollouts?sample={target['sample']}")
        expect(page.locator("#rollouts-table tbody tr")).to_have_count(2)
        expect(page.locator("#sample-signal")).to_have_text("mixed (signal)")
        check_accessibility(page, "sample runs")
        shot(page, "08-sample-runs")

        browser.close()
    assert not page_errors, page_errors
