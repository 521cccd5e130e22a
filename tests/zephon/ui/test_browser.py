"""``zephon ui`` in headless chromium (Debian's /usr/bin/chromium, driven by playwright),
over a catalog filled by real runs: each page's elements are there and its charts drawn,
links and filters are URLs, the page refreshes itself, and the screenshots of docs/ui.md
can be taken. One browser for the module."""

from __future__ import annotations

import os

from tests.zephon.ui.screenshots import PAGES, charts_drawn, shoot


def test_the_runs_page_shows_every_run_with_state_latest_checkpoint_and_goodput(browser, served):
    page = browser.new_page()
    page.goto(f"{served.base}/")  # the home redirects to the runs page
    assert page.url.endswith("/runs")
    rows = page.locator("#runs tr.run")
    assert rows.count() == 2
    alpha = page.locator('#runs tr.run[data-run="alpha"]')
    assert alpha.locator("td.state").inner_text() == "active"
    assert alpha.locator("td.latest").inner_text().startswith("step 8")
    assert alpha.locator("td.goodput").inner_text().endswith("%")
    assert page.locator("#pager").inner_text().strip() == "page 1 of 1"
    page.close()


def test_a_run_page_draws_its_timeline_and_lists_attempts_retention_and_damage(browser, served):
    page = browser.new_page()
    page.goto(f"{served.base}/runs")
    page.click('#runs a[href="/runs/alpha"]')
    page.wait_for_url("**/runs/alpha")
    charts_drawn(page)
    timeline = page.locator("#chart-timeline")
    # the legend names each series: the attempts, the emergency save, the starts
    legend = timeline.locator(".legend-text").all_text_contents()
    assert "emergency save" in legend and "attempt 1" in legend and "attempt start" in legend
    assert timeline.locator(".markers .point").count() >= 6
    # a point's hover text names the save
    hover = timeline.locator('.markers[data-series="emergency save"] .point title')
    assert hover.all_text_contents() == ["emergency save at step 7: committed"]
    phases = page.locator("#chart-phases .legend-text").all_text_contents()
    assert "write_s" in phases and "stall_s" in phases
    bars = page.locator('#chart-phases .bars[data-series="write_s"] .bar')
    assert bars.count() > 0 and bars.first.bounding_box()["height"] > 0
    tiers = page.locator("#chart-tiers .legend-text").all_text_contents()
    assert "upload lag (s)" in tiers and "on local" in tiers and "on save_dir" in tiers
    assert page.locator('#chart-tiers .markers[data-series="on save_dir"] .point').count() >= 3
    # tables: tiers and upload lag, the emergency marker, attempts, retention, damage
    emergency = page.locator('#checkpoints tr.checkpoint.emergency[data-step="7"]')
    assert emergency.locator("td.trigger").inner_text() == "emergency"
    assert page.locator("#checkpoints td.lag").all_inner_texts().count("-") < 6
    tiers_held = page.locator("#checkpoints td.tiers").all_inner_texts()
    assert any("local" in t for t in tiers_held) and any("save_dir" in t for t in tiers_held)
    first = page.locator('#attempts tr.attempt[data-epoch="1"]')
    assert first.locator("td.outcome").inner_text() == "preempted (emergency save)"
    assert page.locator("#attempts tr.attempt").count() >= 3
    assert "2 steps" in page.locator("#attempts td.lost").all_inner_texts()
    assert page.locator("#retention .retention-pinned").inner_text() == "1 pinned"
    assert page.locator("#retention .retention-deleted").inner_text() == "2 deleted"
    assert page.locator("#retention .retention-committed").inner_text() == "3 kept"
    damaged = page.locator("#damaged tr.damaged")
    assert damaged.count() == 1 and "quarantined (corrupt)" in damaged.inner_text()
    assert page.locator("#goodput").inner_text().count("%") == 1
    page.close()


def test_a_filter_is_a_url_that_opens_the_same_view(browser, served):
    page = browser.new_page()
    page.goto(f"{served.base}/runs/alpha?refresh=0")
    page.check('input[name="state"][value="corrupt"]')
    page.click('form.filters button[type="submit"]')
    page.wait_for_url("**/runs/alpha?*state=corrupt*")
    shared = page.url
    assert page.locator("#checkpoints tr.checkpoint").count() == 1
    other = browser.new_page()
    other.goto(shared)
    assert other.locator("#checkpoints tr.checkpoint").count() == 1
    assert other.locator('input[name="state"][value="corrupt"]').is_checked()
    other.close()
    page.close()


def test_the_page_refreshes_itself(browser, served):
    page = browser.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(f"{served.base}/runs/alpha?refresh=1")
    charts_drawn(page)
    page.wait_for_function(
        "() => document.getElementById('refreshed').textContent.startsWith('refreshed')",
        timeout=10_000,
    )
    assert requests.count(f"{served.base}/runs/alpha?refresh=1") >= 2
    charts_drawn(page)  # the charts survive the refresh
    # and every request went to the dashboard itself: nothing from a CDN
    assert all(url.startswith(served.base) for url in requests), requests
    page.close()


def test_the_screenshots_of_each_page_can_be_taken(browser, served, tmp_path):
    written = shoot(browser, served.base, str(tmp_path))
    assert [os.path.basename(p) for p in written] == [name for _, name in PAGES.values()]
    for path in written:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 10_000
