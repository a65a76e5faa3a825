"""The frontend renderer's bounds that hold without a browser: the page server's bookkeeping under a flood,
screenshots cut and refused by size, the browser's memory bound (a cgroup, or a data limit per process)."""
from __future__ import annotations

import base64
import io
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image
from selenium.common.exceptions import TimeoutException

from sweet_jax.envs import browser
from sweet_jax.sandbox.evaluator import _MemoryCgroups


def proxy_get(address: str, url: str) -> int:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return int(s.recv(64).split()[1])


def answered(address: str, url: str) -> int | None:
    """proxy_get's status, None while the server still drops the connection."""
    try:
        return proxy_get(address, url)
    except (OSError, IndexError, ValueError):
        return None


def eventually(condition, seconds: float = 60.0) -> bool:
    """Whether condition() holds within `seconds` (asked every 0.1 s): a bound on waiting, not a timing."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_flood_of_refused_requests_keeps_the_bookkeeping_bounded():
    """A page that fires thousands of requests: each is refused and counted; only the last REFUSED_KEPT lines
    are kept (the list grew by ~100 MB a render)."""
    server = browser.PageServer()
    try:
        for i in range(browser.REFUSED_KEPT + 150):
            assert proxy_get(server.address, f"http://127.0.0.1:9/{'x' * 2000}{i}") == 403
        assert server.refused_count == browser.REFUSED_KEPT + 150
        assert len(server.refused) == browser.REFUSED_KEPT and all(len(line) <= 300 for line in server.refused)
        assert all(line.startswith("GET http://127.0.0.1:9/xxx") for line in server.refused)
    finally:
        server.close()


def test_connections_past_the_limit_are_dropped_not_given_threads(monkeypatch):
    monkeypatch.setattr(browser, "MAX_CONNECTIONS", 8)
    server = browser.PageServer()
    idle = []
    try:
        host, port = server.address.split(":")
        before = threading.active_count()
        for _ in range(40):  # connections that never send a request
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        # the server accepts them in its own thread: wait for it (a loaded host takes longer), then check
        assert eventually(lambda: server.dropped_connections >= 40 - 8), server.dropped_connections
        assert threading.active_count() - before <= 8
        url = server.add("<p>hi</p>")
        for s in idle:
            s.close()
        assert eventually(lambda: answered(server.address, url) == 200)  # slots come back once the flood ends
    finally:
        server.close()


def test_a_wide_page_is_cut_shorter_to_the_pixel_bound():
    assert browser.screenshot_clip(1000, 600) == browser.VIEWPORT  # at least the viewport
    width, height = browser.screenshot_clip(10 ** 6, 10 ** 6)
    assert width == browser.VIEWPORT[0] * 4 and width * height <= browser.MAX_SCREENSHOT_PIXELS
    assert browser.screenshot_clip(1280, 3000) == (1280, 3000)  # an honest long page is untouched


def png_of(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_screenshot_of_noise_is_refused_in_the_renderer_and_an_honest_one_passes(monkeypatch):
    monkeypatch.setattr(browser, "MAX_SCREENSHOT_BYTES", 1 << 20)
    noise = png_of(np.random.default_rng(0).integers(0, 256, (800, 1280, 3), dtype=np.uint8))  # ~3 MB
    with pytest.raises(browser.ScreenshotTooLargeError, match="bytes, more than 1048576"):
        browser.checked_screenshot(noise)
    honest = browser.placeholder_png((1280, 800))
    assert browser.checked_screenshot(honest) == honest


def test_a_screenshot_past_the_pixel_bound_is_refused_from_its_header(monkeypatch):
    monkeypatch.setattr(browser, "MAX_SCREENSHOT_PIXELS", 1000)
    with pytest.raises(browser.ScreenshotTooLargeError, match="40x40 pixels"):
        browser.checked_screenshot(png_of(np.zeros((40, 40, 3), np.uint8)))


class CapturingDriver:
    """What the renderer asks of a WebDriver for one page, with captures of the given sizes in turn."""

    def __init__(self, content, captures):
        self.content, self.captures, self.clips = content, list(captures), []
        self.window_handles = ["main"]
        self.switch_to = type("SwitchTo", (), {"window": lambda self, handle: None})()

    def get(self, url):
        self.host = browser.page_host(url)

    def execute_script(self, script):
        return [self.host, "complete"] if script == browser._PAGE_STATE else None

    def execute_cdp_cmd(self, command, params):
        if command == "Page.getLayoutMetrics":
            return {"cssContentSize": {"width": self.content[0], "height": self.content[1]}}
        if command == "Page.captureScreenshot":
            self.clips.append((params["clip"]["width"], params["clip"]["height"]))
            width, height = self.captures.pop(0)
            return {"data": base64.b64encode(png_of(np.zeros((height, width, 3), np.uint8))).decode()}
        return {}


def fake_renderer(monkeypatch, driver):
    monkeypatch.setattr(browser, "find_browser", lambda: ("chromium", "chromedriver"))
    renderer = browser.Renderer(server=None, max_height=3000)
    renderer._driver = driver
    return renderer


def test_a_capture_at_another_size_than_its_clip_is_taken_again_and_refused_when_it_stays_so(monkeypatch):
    """A capture at another size than its clip (once in CI, on a loaded host, a page cut at 3000 px came back 800
    high; here a 1280x800 capture for a 5120x3000 clip): taken again, and the page lost rather than scored on a
    part of it."""
    driver = CapturingDriver((50000, 5_000_000), [(1280, 800), (5120, 3000)])
    png = fake_renderer(monkeypatch, driver)._screenshot("http://page.invalid/")
    assert Image.open(io.BytesIO(png)).size == (5120, 3000) and driver.clips == [(5120, 3000)] * 2
    driver = CapturingDriver((50000, 5_000_000), [(1280, 800)] * browser.CAPTURE_ATTEMPTS)
    with pytest.raises(browser.ScreenshotSizeError, match="1280x800 screenshot for a 5120x3000 clip 3 times"):
        fake_renderer(monkeypatch, driver)._screenshot("http://page.invalid/")


class EarlyDriver(CapturingDriver):
    """A chromedriver that returns from `get` (or raises its own timeout) before the page has loaded: the window
    shows the blank page, then the page loading, then loaded; its layout is the blank page's 800 px until then."""

    def __init__(self, content, *, states, raises=False):
        super().__init__(content, [content])
        self.states, self.raises, self.loaded = list(states), raises, False

    def get(self, url):
        super().get(url)
        if self.raises:  # the page's navigation, not the blank page's after it
            self.raises = False
            raise TimeoutException("timeout")

    def execute_script(self, script):
        state = self.states.pop(0) if self.states else [self.host, "complete"]
        self.loaded = state == [self.host, "complete"]
        return [state[0] or self.host, state[1]]

    def execute_cdp_cmd(self, command, params):
        if command == "Page.getLayoutMetrics" and not self.loaded:
            return {"cssContentSize": {"width": 1280, "height": 800}}
        return super().execute_cdp_cmd(command, params)


@pytest.mark.parametrize("raises", [False, True], ids=["returns early", "raises its timeout early"])
def test_a_page_is_measured_once_the_window_shows_it_loaded(monkeypatch, raises):
    """With Chromium 150 on a loaded CI host, `get` returned before the page loaded (measured at 800 px, the blank
    page's) or raised chromedriver's 'timeout' 2 s into a 15 s limit: the renderer waits for the page itself."""
    states = [["about:blank", "complete"], [None, "loading"], [None, "interactive"]]
    driver = EarlyDriver((1280, 2000), states=states, raises=raises)
    png = fake_renderer(monkeypatch, driver)._screenshot("http://page.invalid/")
    assert Image.open(io.BytesIO(png)).size == (1280, 2000) and driver.clips == [(1280, 2000)]


def test_a_page_that_never_loads_is_lost_at_its_time_limit(monkeypatch):
    driver = EarlyDriver((1280, 2000), states=[[None, "loading"]] * 10**6)
    renderer = fake_renderer(monkeypatch, driver)
    renderer.time_limit_s = 0.3
    with pytest.raises(browser.PageNotLoadedError, match=r"not loaded after 0.3 s .*readyState 'loading'"):
        renderer._screenshot("http://page.invalid/")
    assert driver.clips == []


class FailingDriver(CapturingDriver):
    """A browser whose driver fails its page after `after_s` seconds (chromedriver's own error, not the page's)."""

    def __init__(self, after_s: float = 0.0):
        super().__init__((1280, 800), [])
        self.after_s = after_s

    def get(self, url):
        time.sleep(self.after_s)
        raise RuntimeError("Message: timeout")


@pytest.mark.parametrize("drivers, rendered, restarts", [
    ("fast, ok", True, 1), ("fast, fast", False, 2), ("slow, ok", False, 1)])
def test_a_page_whose_browser_failed_fast_is_tried_once_more_on_a_fresh_one(monkeypatch, drivers, rendered, restarts):
    """A driver error early in a page's time (as chromedriver's 'timeout' 2 s into a 15 s limit on a loaded CI host)
    gets the page a second, last try on a fresh browser; a failure past half the time limit (a hung page) does not."""
    made = {"fast": lambda: FailingDriver(), "slow": lambda: FailingDriver(after_s=0.35),
            "ok": lambda: CapturingDriver((1280, 900), [(1280, 900)])}
    queue_ = [made[name]() for name in drivers.split(", ")]
    server = browser.PageServer()
    try:
        renderer = fake_renderer(monkeypatch, None)
        renderer.server, renderer.time_limit_s = server, 0.6
        monkeypatch.setattr(renderer, "_start", lambda: setattr(renderer, "_driver", queue_.pop(0)))
        monkeypatch.setattr(renderer, "_kill", lambda: setattr(renderer, "_driver", None))
        render = renderer.render("<body></body>")
        assert (render.png is not None) == rendered and renderer.restarts == restarts
        assert (render.size == (1280, 900)) if rendered else ("RuntimeError: Message: timeout" in render.error)
        assert server.pages == {}
    finally:
        server.close()


ALLOCATE = "x = bytearray({mb} << 20); x[::4096] = b'1' * len(x[::4096]); print('allocated')"


@pytest.mark.parametrize("where", ["data limit", "cgroup"])
def test_the_browser_memory_bound_stops_a_process_past_it_and_lets_one_under_it_run(where):
    cgroups = _MemoryCgroups() if where == "cgroup" else None
    if where == "cgroup" and not cgroups.available:
        pytest.skip("this host gives this process no memory cgroup (the data limit is used instead: tested too)")

    def run(mb):
        preexec, cleanup = browser.memory_bound(200, cgroups)
        try:
            return subprocess.run([sys.executable, "-c", ALLOCATE.format(mb=mb)], preexec_fn=preexec,
                                  capture_output=True, text=True, timeout=60)
        finally:
            cleanup()
    assert run(50).stdout.strip() == "allocated"
    over = run(400)
    assert over.returncode != 0 and "allocated" not in over.stdout
