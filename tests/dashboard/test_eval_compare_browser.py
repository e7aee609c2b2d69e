"""The eval comparison in a real browser: Playwright drives Debian's Chromium against a live server
over an eval with a base run and a fine-tuned run, stored through the models (how runs are made
is tested elsewhere). The test logs in, opens the eval from the list, ticks both runs, reads the
measures and the quadrant counts, checks the charts' points, opens an item from the delta chart
and another from the items table, and sees both trajectories side by side (tool calls, answers,
grades). Screenshot: tests/output/dashboard/eval-compare.png."""

from __future__ import annotations

import pytest

from tests.conftest import live_server
from tests.dashboard.test_browser import CHROMIUM, OUTPUT, check_accessibility, shot
from tests.dashboard.test_browser import pytestmark as needs_chromium
from tests.test_eval_compare import seed_comparison

pytestmark = needs_chromium  # skipped, as test_browser.py is, where Debian's chromium is missing

# Each chart's traces: [name or meta, number of points].
TRACES_JS = """(id) => document.getElementById(id).data.map(t => [t.meta, t.x.length])"""


def cells(page, selector: str) -> list[str]:  # noqa: ANN001
    return [text.strip() for text in page.locator(selector).all_inner_texts()]


@pytest.mark.timeout(300)
def test_comparing_two_runs_in_chromium(settings, project):
    from playwright.sync_api import expect, sync_playwright

    OUTPUT.mkdir(parents=True, exist_ok=True)
    ids = seed_comparison(settings, project["project_id"])
    with live_server(settings) as base, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        page.on("console", lambda msg: page_errors.append(msg.text) if msg.type == "error" else None)
        page.set_default_timeout(30_000)

        page.goto(f"{base}/dashboard/evals")
        page.get_by_label("API key").fill(project["key"])
        page.keyboard.press("Enter")
        page.wait_for_url(f"{base}/dashboard/evals")
        expect(page.locator("#evals-table tbody tr")).to_have_count(1)
        check_accessibility(page, "evals")
        page.get_by_role("link", name="revenue questions").click()

        # The eval: its criteria and runs; tick both and compare.
        expect(page.locator("#criteria-table > tbody > tr")).to_have_count(2)
        expect(page.locator(f'#runs-table tr[data-run-id="{ids["base"]}"]')).to_contain_text("tiny-smollm2")
        check_accessibility(page, "eval")
        page.get_by_label("base model").check()
        page.get_by_label("step 40").check()
        page.get_by_role("button", name="Compare ticked runs").click()
        page.wait_for_url("**/compare?**")

        # The measures with their spreads, one row per run.
        base_row, ft_row = (f'#compare-table tr[data-run-id="{ids[k]}"]' for k in ("base", "ft"))
        expect(page.locator(base_row)).to_contain_text("baseline")
        for row, reward, seconds in ((base_row, "0.667 ± 0.471", "3.00 ± 0.00"), (ft_row, "0.667 ± 0.471", "1.50 ± 0.00")):
            expect(page.locator(f'{row} [data-measure="mean_reward"]')).to_have_text(reward)
            expect(page.locator(f'{row} [data-measure="seconds"]')).to_have_text(seconds)
            expect(page.locator(f'{row} [data-measure="tokens"]')).to_have_text("15.0 ± 0.0")
            expect(page.locator(f'{row} [data-measure="tool_calls"]')).to_have_text("2.00 ± 0.82")
            expect(page.locator(f'{row} [data-measure="pass_rate"]')).to_have_text("67%")
            expect(page.locator(f'{row} [data-measure="items"]')).to_have_text("3")
        expect(page.locator(f'#tools-table tr[data-run-id="{ids["ft"]}"] [data-tool="cat"]')).to_have_text("1.33")
        # The quadrant counts of the fine-tuned run against the base.
        counts = dict(zip(cells(page, "#quadrants-table tbody th"), cells(page, "#quadrants-table tbody td")))
        assert counts == {"improved reward & fewer tools": "1", "improved reward & more tools": "0",
                          "worse reward & fewer tools": "0", "worse reward & more tools": "1",
                          "improved reward & same tools": "0", "worse reward & same tools": "0", "same reward": "1"}

        # The charts: one point per run, one bar group per tool, one delta point per item.
        page.wait_for_function("() => document.body.dataset.chartsDrawn === '1'")
        assert page.evaluate(TRACES_JS, "chart-reward-latency") == [[ids["base"], 1], [ids["ft"], 1]]
        assert page.evaluate(TRACES_JS, "chart-tools") == [[ids["base"], 2], [ids["ft"], 2]]
        assert page.evaluate("() => document.getElementById('chart-tools').data[1].y") == pytest.approx([4 / 3, 2 / 3])
        assert sorted(page.evaluate(TRACES_JS, "chart-deltas")) == [
            ["improved reward & fewer tools", 1], ["same reward", 1], ["worse reward & more tools", 1]]
        check_accessibility(page, "compare")

        # Click the "worse reward & more tools" point: item 2 opens.
        target = page.evaluate("""() => {
            const gd = document.getElementById('chart-deltas'); const trace = gd.data.find(t => t.meta === 'worse reward & more tools');
            const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, box = gd.getBoundingClientRect();
            return {x: box.left + xa._offset + xa.l2p(trace.x[0]), y: box.top + ya._offset + ya.l2p(trace.y[0]),
                    item: trace.customdata[0]};
        }""")
        assert target["item"] == 2
        page.mouse.move(target["x"], target["y"])
        page.mouse.click(target["x"], target["y"])
        page.wait_for_url("**&item=2#trajectories")
        expect(page.locator("#trajectories-title")).to_have_text("Item 2")

        # Item 0 from the items table: the base searched three times and missed, the fine-tuned run read the file.
        page.get_by_role("link", name="Open item 0").click()
        page.wait_for_url("**&item=0#trajectories")
        expect(page.locator('#items-table tr[aria-current="true"]')).to_have_attribute("data-item", "0")
        left, right = (page.locator(f'.trajectory[data-run-id="{ids[k]}"]') for k in ("base", "ft"))
        expect(left.locator(".tool-name")).to_have_text(["search", "search", "search"])
        expect(right.locator(".tool-name")).to_have_text(["search", "cat"])
        expect(left.locator(".final-answer")).to_have_text("41")
        expect(right.locator(".final-answer")).to_have_text("42")
        expect(left.locator('[data-field="result"]')).to_have_text("fail")
        expect(right.locator('[data-field="result"]')).to_have_text("pass")
        expect(left.locator(".grade tbody tr").first).to_contain_text("exact")
        expect(left.locator(".grade tbody tr").first).to_contain_text("0.000")
        expect(right.locator(".grade tbody tr").first).to_contain_text("1.000")
        expect(left.locator(".transcript")).to_contain_text("search says 0")
        expect(right.locator(".msg.role-assistant").first).to_contain_text('→ search({"query": "search 0"})')
        expect(right.locator(".transcript")).to_contain_text("cat says 1")
        one, two = left.bounding_box(), right.bounding_box()
        assert two["x"] >= one["x"] + one["width"] and abs(two["y"] - one["y"]) < 2  # side by side
        check_accessibility(page, "compare item")
        page.locator("#trajectories").scroll_into_view_if_needed()
        shot(page, "eval-compare")
        browser.close()
    assert not page_errors, page_errors
