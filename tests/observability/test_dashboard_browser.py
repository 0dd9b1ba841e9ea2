"""The dashboard in a real headless Chromium (Playwright), against a live sampler.

Checks that the charts draw data and grow as the test drives steps like a trainer,
that HTML in prompts shows as text (never runs), that the rollout filter works and
that the page logs no console errors. The sampler runs with a run token (issue 41): the
page is opened with the link the sampler prints (`/?token=...`), which leaves the address
bar and lives on in a cookie; a browser without it is shown how to get in, and a page whose
polls start answering 401 reloads into that page. Chromium comes from the system (Debian's
`chromium`; `make test` installs it); Playwright's own browser download is not used.
Skips, saying why, only when no Chromium or no Playwright is available.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.observability.htmlenv import PAYLOAD
from tests.observability.support import publish, run_eval, take_batch

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def chromium_path() -> str | None:
    candidates = [os.environ.get("TANDEM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]
    for name in filter(None, candidates):
        found = shutil.which(name) or (name if Path(name).is_file() else None)
        if found:
            return found
    return None


TOKEN = "dashboard-token-41"


@pytest.fixture
def page(tmp_path: Path):
    """A page in a fresh browser profile: no cookie, no token."""
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium found (install Debian's `chromium`, or set TANDEM_CHROMIUM to a Chrome binary)")
    with sync_api.sync_playwright() as pw:
        # A persistent context is how Playwright takes a user-data-dir: a fresh one per test.
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1800},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def wait_live(page, more_than: int = 0) -> None:
    """The page polled the sampler successfully (again), and says so."""
    page.wait_for_function(f"Number(document.body.dataset.updates || 0) > {more_than}", timeout=15000)
    assert page.text_content("#conn") == "live"


def points(page, chart: str) -> int:
    return int(page.get_attribute(f"#chart-{chart}", "data-points") or 0)


def inked_pixels(page, chart: str) -> int:
    """Non-transparent pixels on a chart's canvas: proof that something was drawn."""
    return page.evaluate(
        """(id) => { const c = document.getElementById(id);
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""",
        f"chart-{chart}",
    )


# What a trainer from before issue 29 sends with each version, and the correction metrics since.
OLD_TRAINER_METRICS = {"behaviour_mismatch": 0.01, "loss": -0.1, "is_weight_mean": 0.99, "is_truncated_fraction": 0.0}
CORRECTION_METRICS = {"mismatch_k1": -0.002, "mismatch_k2": 0.004, "mismatch_k3": 0.005, "is_masked_fraction": 0.01,
                      "rejected_fraction": 0.05, "is_weight_raw_mean": 1.01, "is_weight_raw_max": 7.5}


def test_dashboard_live_charts_escaping_and_filter(make_sampler, page):
    sampler = make_sampler(env="tests.observability.htmlenv:HtmlEnv", max_staleness=1, api_token=TOKEN)
    problems: list[str] = []
    page.on("console", lambda msg: msg.type in ("error", "warning") and problems.append(f"{msg.type}: {msg.text}"))
    page.on("pageerror", lambda exc: problems.append(f"pageerror: {exc}"))

    take_batch(sampler.url, 0, token=TOKEN)
    # The link the sampler prints: the token goes into a cookie and out of the address bar.
    page.goto(f"{sampler.url}/?token={TOKEN}&interval=200")
    assert page.url == f"{sampler.url}/?interval=200"
    assert TOKEN not in page.url
    page.wait_for_function("document.getElementById('chart-reward').dataset.points >= 1", timeout=15000)
    page.wait_for_selector("#rollouts tbody tr", timeout=15000)
    before = {chart: points(page, chart) for chart in ("reward", "timeline")}
    assert page.text_content("#published") == "0"

    # Untrusted text: the HTML in the prompt is shown literally and nothing of it runs.
    prompt = page.text_content("#rollouts tbody tr td.prompt")
    assert PAYLOAD in prompt
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#rollouts img, #rollouts script, #rollouts b").count() == 0

    # Drive three trainer steps and an eval; the page must follow without a reload. Version 1
    # comes from a trainer older than the off-policy correction metrics (issue 29): its chart
    # stays empty and nothing breaks; versions 2 and 3 carry them, 3 per staleness as well.
    assert points(page, "offpolicy") == 0 and points(page, "correction") == 0
    publish(sampler.url, 1, metrics=OLD_TRAINER_METRICS, token=TOKEN)
    page.wait_for_function("document.getElementById('chart-mismatch').dataset.points === '1'", timeout=15000)
    assert points(page, "offpolicy") == 0  # nothing to draw, no error
    assert points(page, "correction") == 1  # is_truncated_fraction, which older trainers send
    take_batch(sampler.url, 1, token=TOKEN)
    publish(sampler.url, 2, metrics={**OLD_TRAINER_METRICS, **CORRECTION_METRICS}, token=TOKEN)
    take_batch(sampler.url, 2, token=TOKEN)
    publish(sampler.url, 3, metrics={**OLD_TRAINER_METRICS, **CORRECTION_METRICS, "mismatch_k3_stale0": 0.001,
                                     "mismatch_k3_stale1": 0.02, "rejected_fraction_stale1": 0.25}, token=TOKEN)
    run_eval(sampler.url, num_examples=3, token=TOKEN)
    page.wait_for_function("document.getElementById('published').textContent === '3'", timeout=15000)
    page.wait_for_function("document.getElementById('eval-reward').textContent !== '–'", timeout=15000)
    page.wait_for_function(
        f"document.getElementById('chart-reward').dataset.points >= {before['reward'] + 3}", timeout=15000)
    page.wait_for_function("document.getElementById('chart-cps').dataset.points >= 2", timeout=15000)
    assert points(page, "timeline") > before["timeline"]
    assert points(page, "staleness") >= 2  # staleness 0 (step 0) and 1 (later steps, k = 1)
    assert int(page.text_content("#next-step")) >= 3
    # k3 and k1 at versions 2 and 3, k3 of staleness 0 and 1 at version 3; masked, rejected and
    # truncated fractions at versions 2 and 3, truncated alone at version 1.
    page.wait_for_function("document.getElementById('chart-offpolicy').dataset.points === '6'", timeout=15000)
    assert points(page, "correction") == 7
    assert points(page, "mismatch") == 3
    for chart in ("reward", "staleness", "timeline", "cps", "tps", "mismatch", "offpolicy", "correction"):
        assert inked_pixels(page, chart) > 500, chart
    servers = page.text_content("#servers tbody")
    assert "127.0.0.1" in servers
    assert page.get_attribute("#servers tbody tr", "data-state") == "ok"
    # The server's history: it became a member and went into rotation, then synced versions.
    events = page.text_content("#server-events tbody")
    assert "member of the run" in events and "joining -> ok at version 0" in events, events

    # The rollout filter narrows the table.
    page.fill("#filter-step", "1")
    steps = page.locator("#rollouts tbody tr td:first-child").all_text_contents()
    assert steps and set(steps) == {"1"}
    page.fill("#filter-step", "")
    page.fill("#filter-text", "no rollout contains this")
    assert page.locator("#rollouts tbody tr").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert int(page.evaluate("document.body.dataset.updates")) >= 3  # it polled, it did not reload
    assert problems == []

    # Opened again without the token in the address: the cookie keeps it live.
    page.goto(f"{sampler.url}/")
    assert page.url == f"{sampler.url}/"
    wait_live(page)
    assert page.text_content("#published") == "3"
    assert problems == []


def test_dashboard_without_the_token_says_how_to_get_in(make_sampler, page):
    sampler = make_sampler(api_token=TOKEN)
    page.goto(f"{sampler.url}/?interval=200")
    # Not a broken dashboard: the sampler's page saying what to do, with a form for the token.
    assert "needs its run token" in page.text_content("h1")
    assert "has not been given the token yet" in page.text_content("#why")
    assert page.locator("#conn").count() == 0
    # A wrong token: the page again, saying so.
    page.fill("input[name=token]", "not-the-token")
    page.click("button[type=submit]")
    page.wait_for_selector("text=That token is not this run's token.")
    # The right one, pasted: the live dashboard, the token out of the address bar.
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("#conn")
    assert page.url == f"{sampler.url}/"
    wait_live(page)


def test_dashboard_reloads_into_the_login_page_when_its_token_stops_working(make_sampler, page):
    """As after a restart with a new token: the polls answer 401, and the page, rather than
    showing "disconnected" forever, reloads into the page that says how to get in."""
    sampler = make_sampler(api_token=TOKEN)
    page.goto(f"{sampler.url}/?token={TOKEN}&interval=200")
    wait_live(page)
    # The cookie is gone (cleared, expired): the next poll's 401 reloads into the login page.
    page.context.clear_cookies()
    page.wait_for_selector("text=needs its run token", timeout=15000)
    assert "has not been given the token yet" in page.text_content("#why")
    assert page.url == f"{sampler.url}/?interval=200"
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("#conn")
    wait_live(page)
    # The sampler restarts, on the same port, with a new token: the page keeps polling through
    # the restart, then reloads into the login page, which says why.
    sampler.stop()
    make_sampler(api_token="a-new-token", port=sampler.port)
    page.wait_for_selector("text=needs its run token", timeout=20000)
    assert "no longer this run's" in page.text_content("#why")
