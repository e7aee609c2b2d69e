"""The eval pages over HTTP, as a browser without JavaScript sees them: the evals list, an eval's
runs with the compare form, the comparison page with an item's trajectories side by side, its
JSON and CSV, and the errors a comparison can meet (a page, never a 500 or the API's JSON).
(tests/dashboard/test_eval_compare_browser.py drives a real Chromium.)"""

from __future__ import annotations

import csv
import io

from tests.conftest import make_project
from tests.dashboard.helpers import login
from tests.test_eval_compare import seed_comparison


def compare_url(ids: dict[str, str], *runs: str, **params: str) -> str:
    query = "&".join([*(f"runs={ids[r]}" for r in runs), *(f"{k}={v}" for k, v in params.items())])
    return f"/dashboard/evals/{ids['eval']}/compare?{query}"


def test_the_evals_list_and_an_evals_runs(client, settings, project):
    ids = seed_comparison(settings, project["project_id"])
    newer = seed_comparison(settings, project["project_id"])
    seed_comparison(settings, make_project(settings)["project_id"])  # another project's: never listed
    login(client, project["key"])
    listing = client.get("/dashboard/evals")
    assert listing.status_code == 200 and '<a href="/dashboard/evals">Evals</a>' in listing.text
    assert listing.text.count('<tr data-eval-id="') == 2
    assert listing.text.index(newer["eval"]) < listing.text.index(ids["eval"])  # newest first
    assert "2 evals, newest first." in listing.text
    page = client.get(f"/dashboard/evals/{ids['eval']}")
    assert page.status_code == 200
    assert 'action="/dashboard/evals/' + ids["eval"] + '/compare"' in page.text
    for run in (ids["base"], ids["ft"]):
        assert f'<input type="checkbox" name="runs" value="{run}" id="pick-{run}">' in page.text
    assert "<th scope=\"row\">exact</th>" in page.text and "completed" in page.text
    # The base run: 2 passed, 1 failed, no errors, 3 output items.
    row = page.text.split(f'<tr data-run-id="{ids["base"]}">', 1)[1].split("</tr>", 1)[0]
    assert [c.split(">")[-1] for c in row.split("</td>") if 'class="num"' in c][:4] == ["2", "1", "0", "3 (3 items)"]


def test_the_compare_page_shows_the_measures_and_an_items_trajectories(client, settings, project):
    ids = seed_comparison(settings, project["project_id"])
    login(client, project["key"])
    page = client.get(f"/dashboard/evals/{ids['eval']}/compare?runs={ids['base']},{ids['ft']}")
    assert page.status_code == 200, page.text[:500]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/static/evals.js"></script>' in page.text
    assert '<td class="num" data-measure="seconds">3.00 <span class="muted">± 0.00</span></td>' in page.text
    assert '<td class="num" data-measure="items">3</td>' in page.text
    assert 'data-quadrant="improved reward &amp; fewer tools"' in page.text
    assert 'id="trajectories"' not in page.text
    same = client.get(compare_url(ids, "base", "ft", item="0"))  # runs given twice, the same page
    assert same.status_code == 200 and 'id="trajectories"' in same.text
    panels = same.text.split('<section class="card trajectory"')[1:]
    assert len(panels) == 2 and ids["base"] in panels[0] and ids["ft"] in panels[1]
    assert '<strong class="tool-name">search</strong>' in panels[0] and '<strong class="tool-name">cat</strong>' in panels[1]
    assert '<pre class="content final-answer">41</pre>' in panels[0] and '<pre class="content final-answer">42</pre>' in panels[1]
    data = client.get(f"/dashboard/evals/{ids['eval']}/compare/data?runs={ids['base']}&runs={ids['ft']}")
    assert data.status_code == 200 and data.json()["object"] == "eval.comparison"
    assert data.json()["quadrants"][ids["ft"]]["worse reward & more tools"] == 1
    per_item = client.get(f"/dashboard/evals/{ids['eval']}/compare.csv?runs={ids['base']},{ids['ft']}&per_item=true")
    assert per_item.status_code == 200 and per_item.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(per_item.text)))
    assert [r[f"{ids['ft']}:quadrant"] for r in rows] == ["improved reward & fewer tools", "same reward",
                                                            "worse reward & more tools"]


def test_a_comparison_that_cannot_be_made_is_a_page(client, settings, project):
    ids = seed_comparison(settings, project["project_id"])
    theirs = seed_comparison(settings, make_project(settings)["project_id"])
    login(client, project["key"])
    one = client.get(compare_url(ids, "base"))
    assert one.status_code == 400 and one.headers["content-type"].startswith("text/html")
    assert "Compare at least 2 distinct runs" in one.text and f'href="/dashboard/evals/{ids["eval"]}"' in one.text
    unknown = client.get(f"/dashboard/evals/{ids['eval']}/compare?runs={ids['base']},evalrun_nope")
    assert unknown.status_code == 404 and "There is no eval run evalrun_nope in this project." in unknown.text
    foreign = client.get(f"/dashboard/evals/{ids['eval']}/compare?runs={ids['base']},{theirs['ft']}")
    assert foreign.status_code == 404 and f"There is no eval run {theirs['ft']}" in foreign.text
    for path in ("", f"/compare?runs={theirs['base']},{theirs['ft']}"):
        page = client.get(f"/dashboard/evals/{theirs['eval']}{path}")
        assert page.status_code == 404 and f"There is no eval {theirs['eval']} in this project." in page.text
    data = client.get(f"/dashboard/evals/{ids['eval']}/compare/data?runs={ids['base']}")
    assert data.status_code == 400 and data.json()["error"]["code"] == "invalid_value"
    bad_item = client.get(compare_url(ids, "base", "ft", item="x"))
    assert bad_item.status_code == 200 and "item must be a whole number" in bad_item.text
    missing = client.get(compare_url(ids, "base", "ft", item="7"))
    assert missing.status_code == 200 and "None of these runs has item 7." in missing.text
    assert client.get("/dashboard/evals/eval_nope/compare", follow_redirects=False).status_code == 404
