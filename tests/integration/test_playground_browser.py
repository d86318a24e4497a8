"""The playground in a real browser: Debian's chromium driven by Playwright sends a prompt to
the tiny-model pipeline, shows the streamed answer (the same text as transformers' greedy
generate), TTFT and ITL, and the request's timeline as bars. Skipped, saying how to install
the browser, where /usr/bin/chromium is missing. Set PD_PLAYGROUND_SCREENSHOT to a path to
keep a screenshot (docs/playground.png is made that way)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.integration.test_pipeline import reference_text

pytestmark = pytest.mark.timeout(300)
CHROMIUM = Path("/usr/bin/chromium")
PROMPT = "Hello there"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("the playground test needs Debian's chromium: `sudo apt-get install -y chromium` "
                    "(Playwright drives /usr/bin/chromium; no browser is downloaded)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # root (CI) cannot use chromium's sandbox
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def test_playground_streams_an_answer_and_draws_its_timeline(browser, pipeline, tiny_model, tmp_path):
    expected, _, _ = reference_text(tiny_model, PROMPT, MAX_TOKENS)
    page = browser.new_page(viewport={"width": 1200, "height": 820})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(pipeline.url + "/")
    page.wait_for_selector("#model option[value='tiny-llama']", state="attached")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    answer.locator(".timeline .bar").first.wait_for(timeout=120_000)
    assert answer.locator(".content").inner_text() == expected
    chunks = int(answer.locator(".stats b").nth(3).inner_text())
    assert chunks >= 2  # the text came as a stream of deltas, not in one piece
    assert answer.locator(".ttft").inner_text().endswith(" ms")
    assert answer.locator(".itl").inner_text().endswith(" ms")
    phases = answer.locator(".timeline .bar").evaluate_all("bars => bars.map(b => b.dataset.phase)")
    for phase in ("tokenize", "prefill", "decode", "postfilter"):
        assert phase in phases, phases
    widths = answer.locator(".timeline .bar").evaluate_all("bars => bars.map(b => b.getBoundingClientRect().width)")
    assert sum(widths) > 100  # drawn, not empty
    assert answer.locator(".timeline .bar.g-prefill").count() == 1
    box = answer.locator(".timeline").bounding_box()
    for swatch in answer.locator(".timeline .swatch").all():  # the legend sits inside its timeline
        b = swatch.bounding_box()
        assert box["y"] <= b["y"] <= box["y"] + box["height"]
    assert errors == []
    shot = tmp_path / "playground.png"
    page.screenshot(path=str(shot))
    if os.environ.get("PD_PLAYGROUND_SCREENSHOT"):
        shutil.copy(shot, os.environ["PD_PLAYGROUND_SCREENSHOT"])
    page.close()
