"""The live dashboard in a real headless browser (Debian's chromium + chromedriver)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip(
        "the dashboard test needs Debian's chromium and chromium-driver "
        "(apt-get install chromium chromium-driver; .ci/run installs them)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver")

import httpx  # noqa: E402

from kvevents.demo.stack import LocalStack  # noqa: E402
from kvevents.serve import ServeConfig  # noqa: E402
from kvevents.serve.loadgen import LoadgenConfig, run_loadgen  # noqa: E402

ARTIFACTS = Path(os.environ.get("KVEVENTS_TEST_ARTIFACTS", "test-artifacts"))


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except Exception:  # the page may be mid-update: look again
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture()
def browser():  # type: ignore[no-untyped-def]
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1100"):  # fmt: skip
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def test_dashboard_shows_engines_updates_and_survives_an_engine_loss(browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with LocalStack(3, serve=ServeConfig(scrape_interval_s=0.25)) as s:
        wait_until(lambda: httpx.get(s.url + "/readyz").status_code == 200, what="/readyz")
        browser.get(s.url + "/")
        assert browser.title == "kvevents serve"

        def cards() -> dict[str, object]:
            return {
                c.get_attribute("data-worker"): c
                for c in browser.find_elements(By.CSS_SELECTOR, "#engines .card")
            }

        wait_until(lambda: set(cards()) == {"sim-0:0", "sim-1:0", "sim-2:0"}, what="3 cards")

        def routed() -> int:
            return sum(
                int(float(e.text))
                for e in browser.find_elements(By.CSS_SELECTOR, '[data-kpi="routed"]')
            )

        assert routed() == 0
        # requests flow while the page polls
        cfg = LoadgenConfig(s.url, requests=90, sessions=8, concurrency=None, rate=25.0)
        done = threading.Event()
        t = threading.Thread(target=lambda: (asyncio.run(run_loadgen(cfg)), done.set()))
        t.start()
        wait_until(lambda: routed() > 0, what="routed counts to rise on the page")
        t.join(timeout=60)
        assert done.is_set()
        wait_until(lambda: routed() == 90, what="all 90 requests on the page")
        gpu = browser.find_elements(By.CSS_SELECTOR, '.num[data-tier="GPU"]')
        assert any(not g.text.startswith("0 ") for g in gpu)
        # the truth check of the last answer may reach the page one poll after its count
        wait_until(
            lambda: browser.find_element(By.CSS_SELECTOR, "#exact-rate").text.endswith("of 90"),
            what="the truth check of all 90 requests on the page",
        )
        assert browser.find_element(By.ID, "status").text == "ready"
        browser.save_screenshot(str(ARTIFACTS / "serve-dashboard.png"))

        # an engine goes away: its card stays, marked down; the page keeps updating
        s.stop_engine(2)
        httpx.post(s.url + "/v1/completions", json={"prompt": "after the loss", "max_tokens": 2})
        wait_until(
            lambda: "down" in (cards()["sim-2:0"].get_attribute("class") or ""),  # type: ignore[attr-defined]
            what="the lost engine's card to show it down",
        )
        stamp = browser.find_element(By.TAG_NAME, "body").get_attribute("data-updated")
        wait_until(
            lambda: (
                browser.find_element(By.TAG_NAME, "body").get_attribute("data-updated") != stamp
            ),
            what="the page to keep updating",
        )
        assert "engine(s) down" in browser.find_element(By.ID, "status").text
        assert set(cards()) == {"sim-0:0", "sim-1:0", "sim-2:0"}
        browser.save_screenshot(str(ARTIFACTS / "serve-dashboard-engine-down.png"))
