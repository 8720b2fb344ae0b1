"""The web page's progress bar in headless Chromium: nothing drawn while idle (it was the browser's
default bar, a full white track on the dark page), and a visible failed state (a red bar and a red
status) when a request fails."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from qwenfast.server.run import load_pipeline  # noqa: E402
from tests import test_server as S  # noqa: E402

browser = S.browser  # the headless Chromium fixture of the server tests


@pytest.fixture(scope="module")
def base():
    pipe = load_pipeline(None, device="cpu", dtype="fp32")
    with S.running(pipe) as (url, _):
        yield url


def _pixels(page, selector: str) -> np.ndarray:
    """What is drawn where `selector` is laid out (also while it is hidden), as RGB ints."""
    r = page.eval_on_selector(selector, "e => { const r = e.getBoundingClientRect(); "
                                        "return {x: r.x, y: r.y, width: r.width, height: r.height}; }")
    assert r["width"] > 100 and r["height"] >= 8, r
    return np.asarray(Image.open(io.BytesIO(page.screenshot(clip=r))).convert("RGB")).astype(int)


def test_idle_bar_draws_nothing_and_a_failed_request_shows_a_red_bar(base, browser):
    page, errors = S._open(browser, base + "/", "demo-t2i")
    try:
        assert page.eval_on_selector("#progress", "p => getComputedStyle(p).visibility") == "hidden"
        idle = _pixels(page, "#progress")  # the old idle bar: the browser's light track, all of it
        assert idle.max() < 60, f"the idle bar's area is drawn: brightest {idle.max()}"

        page.fill("#prompt", "a small red circle at the top left, blue background")
        page.fill("#seed", "99999999999999999999")  # beyond the seed range: the server answers 400
        page.click("#generate")
        page.wait_for_function("() => document.getElementById('status').textContent === 'failed'")
        assert "`seed` must be in 0..9223372036854775807" in page.inner_text("#message")
        assert page.eval_on_selector("#progress", "p => getComputedStyle(p).visibility") == "visible"
        assert page.get_attribute("#progress", "data-state") == "failed"
        bar = _pixels(page, "#progress")
        red = ((bar[..., 0] > 200) & (bar[..., 1] < 140) & (bar[..., 2] < 140)).mean()
        assert red > 0.5, f"only {red:.0%} of the failed bar is red"
        status = page.eval_on_selector("#status", "s => getComputedStyle(s).color")
        assert status == "rgb(255, 107, 107)", status  # --err
        assert not errors, errors
    finally:
        page.context.close()
