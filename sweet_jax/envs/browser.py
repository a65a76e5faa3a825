"""Screenshots of untrusted HTML pages in a headless Chromium (Debian's `chromium` + `chromium-driver`), driven by
selenium, for ColBench's frontend track.

How a page is contained:
- The browser's only way out is a proxy in this process (`PageServer`, on 127.0.0.1) that answers exactly two
  kinds of request: the page being rendered (at `http://<random-name>.invalid/`) and the placeholder picture
  (`sweet_jax.data.frontend.placeholder_url(width, height)`). Everything else, loopback included
  (`--proxy-bypass-list=<-loopback>`), gets 403; HTTPS/WebSocket tunnels (CONNECT) are refused; host-name
  resolution is switched off; WebRTC may not use UDP outside the proxy. So a page reaches neither the network nor any port on the host (chromedriver's own
  included).
- The page is served over http, so the browser refuses its file:// loads (iframes, images, fetches): it sees
  no file but itself and the placeholder.
- Scripts run inside Chromium's processes, never in this one. Each render has a time limit: a page that has
  not rendered by then (an endless script, a huge DOM) gets no screenshot and its browser is killed and
  started afresh. A page is measured once the window shows it loaded, and a page whose browser failed fast
  (a driver error within half the limit) is tried once more on a fresh browser. `window.open`, `alert`,
  `confirm`, `prompt` and `print` do nothing; any window a page still manages to open is closed after the
  render.
- Full-page screenshots have a fixed viewport (`VIEWPORT`, CSS pixels at scale 1) and are cut at
  `MAX_PAGE_HEIGHT` and at `MAX_SCREENSHOT_PIXELS`; a PNG over `MAX_SCREENSHOT_BYTES` (a canvas of random
  pixels does not compress) is refused in the renderer, so it is neither kept per page nor posted to the
  vision simulator. A capture that comes back at another size than its clip is taken again, up to
  `CAPTURE_ATTEMPTS` times, and the page is lost after that (never scored on a part of itself).
- Each browser has a memory bound (`BROWSER_MEMORY_MB`): a memory cgroup around the whole browser where this
  process may make one, else a per-process data limit (RLIMIT_DATA, which Chromium's address-space
  reservations do not count against), and a V8 heap limit. A page past it crashes its renderer: the page gets no
  screenshot and the browser is started afresh.
- Nothing of a page reaches the next: after each page the browser goes back to one blank window whose name
  (`window.name`, which survives navigations) is cleared and whose session history is reset to that blank page
  (no back-forward cache keeps a page alive); every page has its own origin, so no storage is shared.
- The proxy's bookkeeping is bounded: it keeps the last `REFUSED_KEPT` refused requests (and a count), and
  answers at most `MAX_CONNECTIONS` connections at a time (a flood is dropped, not queued in threads).
"""
from __future__ import annotations

import base64
import collections
import concurrent.futures
import dataclasses
import functools
import http.server
import io
import logging
import os
import queue
import re
import resource
import secrets
import shutil
import signal
import socketserver
import tempfile
import threading
import time
from typing import Sequence

from PIL import Image

from sweet_jax import lazy
from sweet_jax.data.frontend import MAX_PLACEHOLDER_SIDE, PLACEHOLDER_HOST, placeholder_url
from sweet_jax.errors import SweetJaxError
from sweet_jax.sandbox.evaluator import _MemoryCgroups

log = logging.getLogger(__name__)

VIEWPORT = (1280, 800)         # (width, height) in CSS pixels: a common laptop screen, fixed for every page
MAX_PAGE_HEIGHT = 8000         # full-page screenshots are cut here
MAX_SCREENSHOT_PIXELS = 2 * VIEWPORT[0] * MAX_PAGE_HEIGHT  # a page over two viewports wide is cut shorter
MAX_SCREENSHOT_BYTES = 16 << 20  # an honest page's PNG is well under 2 MB; random pixels are ~3 bytes a pixel
BROWSER_MEMORY_MB = 2048       # one browser with its page (honest pages use a few hundred MB)
REFUSED_KEPT = 100             # refused proxy requests remembered (for tests and logs)
MAX_CONNECTIONS = 64           # proxy connections answered at a time
CAPTURE_ATTEMPTS = 3           # captures of a page whose screenshot comes back at another size than its clip
PAGE_TIME_LIMIT_S = 15.0       # load + layout + screenshot of one page
PLACEHOLDER_URL = placeholder_url(400, 300)   # what tests and demo pages show

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--disable-extensions", "--disable-default-apps", "--mute-audio",
    "--hide-scrollbars", "--force-device-scale-factor=1", "--dns-prefetch-disable",
    "--disable-back-forward-cache",            # no page is kept alive after it is left
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # no name resolves; the proxy is an address
    "--proxy-bypass-list=<-loopback>",         # loopback goes through the proxy too, which refuses it
    f"--js-flags=--max-old-space-size={BROWSER_MEMORY_MB // 4}",  # a page's JS heap, inside the memory bound
)
# Run in every frame before the page's own scripts: dialogs and pop-ups become no-ops.
_QUIET_DIALOGS = """
(() => { const none = () => null;
  for (const name of ['alert', 'confirm', 'prompt', 'print', 'open']) {
    try { Object.defineProperty(window, name, {value: none, writable: false, configurable: false}); } catch (e) {}
  } })();
"""


class BrowserNotFoundError(SweetJaxError):
    """No Chromium / chromedriver on this machine."""


@functools.lru_cache(maxsize=64)
def placeholder_png(size=(400, 300)) -> bytes:
    """A grey picture with a darker band at the top and bottom: what every picture of a frontend task shows."""
    image = Image.new("RGB", size, (190, 190, 190))
    image.paste((140, 140, 140), (0, 0, size[0], 8))
    image.paste((140, 140, 140), (0, size[1] - 8, size[0], size[1]))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class PageServer:
    """The browsers' proxy: serves the pages being rendered and the placeholder image; refuses all else."""

    def __init__(self):
        self.pages: dict[str, bytes] = {}          # host -> HTML (only while its page renders)
        self.refused: collections.deque[str] = collections.deque(maxlen=REFUSED_KEPT)  # the last request lines
        self.refused_count = 0                     # refused requests in all
        self.dropped_connections = 0              # connections past MAX_CONNECTIONS, closed unanswered
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        server = self
        picture = re.compile(rf"http://{re.escape(PLACEHOLDER_HOST)}/(\d+)x(\d+)\.png")

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 — the stdlib's naming
                # A proxy request names the full URL: "GET http://host/path HTTP/1.1".
                url = self.path
                if (match := picture.fullmatch(url)) and all(
                        1 <= int(side) <= MAX_PLACEHOLDER_SIDE for side in match.groups()):
                    return self._send(200, "image/png", placeholder_png(tuple(map(int, match.groups()))))
                host, _, path = url.removeprefix("http://").partition("/")
                body = server.pages.get(host) if url.startswith("http://") and path == "" else None
                if body is not None:
                    return self._send(200, "text/html; charset=utf-8", body)
                self._refuse()

            def _send(self, code, content_type, body):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _refuse(self):
                with server._lock:
                    server.refused.append(self.requestline[:300])
                    server.refused_count += 1
                self._send(403, "text/plain", b"")

            do_HEAD = do_GET  # noqa: N815
            do_POST = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = do_CONNECT = _refuse  # noqa: N815

            def log_message(self, *args):
                pass

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            request_queue_size = MAX_CONNECTIONS

            def process_request(self, request, client_address):
                if not server._slots.acquire(blocking=False):  # a flood: no thread, no queue, no answer
                    with server._lock:
                        server.dropped_connections += 1
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address):
                try:
                    request.settimeout(PAGE_TIME_LIMIT_S)  # a connection that sends nothing frees its slot
                    super().process_request_thread(request, client_address)
                finally:
                    server._slots.release()

            def handle_error(self, request, client_address):
                pass  # a browser that hangs up mid-answer (a page closed, a killed renderer) is routine

        self._server = Server(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="page-server", daemon=True).start()

    def add(self, html: str) -> str:
        """Serve `html` at a fresh, unguessable origin; returns its URL."""
        host = f"p{secrets.token_hex(8)}.invalid"
        self.pages[host] = html.encode("utf-8", errors="replace")
        return f"http://{host}/"

    def remove(self, url: str) -> None:
        self.pages.pop(page_host(url), None)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def page_host(url: str) -> str:
    """The host of a page's URL as PageServer.add makes it (http://<host>/): its key, and its window's origin."""
    return url.removeprefix("http://").partition("/")[0]


def find_browser() -> tuple[str, str]:
    """(chromium binary, chromedriver) on this machine, or a clear error saying how to install them."""
    browser = next((p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium"),
                                shutil.which("chromium-browser"), shutil.which("google-chrome"))
                    if p and os.path.exists(p)), None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver")
                                              else None)
    if browser is None or driver is None:
        raise BrowserNotFoundError(
            "the frontend renderer needs Chromium and its driver; on Debian/Ubuntu: "
            "apt-get install -y chromium chromium-driver")
    return browser, driver


class ScreenshotTooLargeError(SweetJaxError):
    """A page whose screenshot is past MAX_SCREENSHOT_BYTES or MAX_SCREENSHOT_PIXELS."""


def screenshot_clip(content_width: int, content_height: int, viewport=VIEWPORT,
                    max_height: int = MAX_PAGE_HEIGHT) -> tuple[int, int]:
    """(width, height) of a page's full-page screenshot: at least the viewport, at most 4 viewports wide and
    max_height high, and cut shorter so that it holds at most MAX_SCREENSHOT_PIXELS."""
    width = max(viewport[0], min(int(content_width), viewport[0] * 4))
    height = max(viewport[1], min(int(content_height), max_height))
    return width, max(1, min(height, MAX_SCREENSHOT_PIXELS // width))


class PageNotLoadedError(SweetJaxError):
    """The browser did not show the page, loaded, within its time limit."""


# The window's origin (each page has its own: a page that changes its own path or hash keeps it) and load state.
_PAGE_STATE = "return [location.host, document.readyState];"


class ScreenshotSizeError(SweetJaxError):
    """The browser's screenshot is not the size of the clip asked for: the page is lost, not scored on a part."""


def _png_size(data: str) -> tuple[int, int]:
    """(width, height) from a base64 PNG's header (its IHDR chunk: bytes 16-24), without decoding the rest."""
    header = base64.b64decode(data[:32])
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def checked_screenshot(png: bytes) -> bytes:
    """`png` if it is within MAX_SCREENSHOT_BYTES and MAX_SCREENSHOT_PIXELS (its header says), else
    ScreenshotTooLargeError: what leaves the renderer is bounded whatever the page drew."""
    if len(png) > MAX_SCREENSHOT_BYTES:
        raise ScreenshotTooLargeError(f"the page's screenshot is {len(png)} bytes, more than {MAX_SCREENSHOT_BYTES} "
                                      "(browser.MAX_SCREENSHOT_BYTES): a page of noise, not a web page")
    width, height = Image.open(io.BytesIO(png)).size  # reads the header only
    if width * height > MAX_SCREENSHOT_PIXELS:
        raise ScreenshotTooLargeError(f"the page's screenshot is {width}x{height} pixels, more than "
                                      f"{MAX_SCREENSHOT_PIXELS} (browser.MAX_SCREENSHOT_PIXELS)")
    return png


def memory_bound(limit_mb: int, cgroups=None):
    """(preexec_fn for the browser's Popen, cleanup): the browser and every process it starts in a memory cgroup
    of limit_mb where `cgroups` (sandbox's _MemoryCgroups) can make one, else each of its processes under an
    RLIMIT_DATA of limit_mb. cleanup removes the cgroup once the browser is gone."""
    path = cgroups.create(limit_mb) if cgroups is not None and cgroups.available else None
    if path is not None:
        procs = os.path.join(path, "cgroup.procs")

        def enter_cgroup():  # in the child, before exec: all it starts stays inside
            with open(procs, "w") as f:
                f.write("0")
        return enter_cgroup, lambda: cgroups.remove(path)

    def limit_data():
        resource.setrlimit(resource.RLIMIT_DATA, (limit_mb << 20, limit_mb << 20))
    return limit_data, lambda: None


@dataclasses.dataclass
class Render:
    png: bytes | None        # the full-page screenshot, None when the page did not render
    error: str | None = None
    seconds: float = 0.0

    @property
    def size(self) -> tuple[int, int] | None:
        return Image.open(io.BytesIO(self.png)).size if self.png else None


class Renderer:
    """One headless Chromium (restarted when a page hangs it). Not thread-safe: a pool holds several."""

    def __init__(self, server: PageServer, *, viewport=VIEWPORT, time_limit_s: float = PAGE_TIME_LIMIT_S,
                 max_height: int = MAX_PAGE_HEIGHT, memory_mb: int = BROWSER_MEMORY_MB):
        self.server, self.viewport, self.time_limit_s, self.max_height = server, viewport, time_limit_s, max_height
        self.memory_mb = memory_mb
        self._release_memory_bound = lambda: None
        self.browser, self.driver_path = find_browser()
        self._driver = None
        self._profile = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="renderer")
        self.restarts = 0

    def _start(self):
        webdriver = lazy.selenium_webdriver()
        self._profile = tempfile.mkdtemp(prefix="sweet_jax_chromium_")
        options = webdriver.ChromeOptions()
        options.binary_location = self.browser
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--proxy-server=http://{self.server.address}")
        options.add_argument(f"--user-data-dir={self._profile}")
        options.add_argument(f"--window-size={self.viewport[0]},{self.viewport[1]}")
        options.add_experimental_option("excludeSwitches", ["disable-popup-blocking", "enable-automation"])
        options.unhandled_prompt_behavior = "dismiss"
        options.page_load_strategy = "normal"
        # Own session: a hung browser is killed with its whole process group. Its memory bound holds the whole
        # browser (a cgroup) or each of its processes (a data limit).
        preexec, self._release_memory_bound = memory_bound(self.memory_mb, _MemoryCgroups())
        service = webdriver.ChromeService(self.driver_path, log_output=os.devnull,
                                          popen_kw={"start_new_session": True, "preexec_fn": preexec})
        driver = webdriver.Chrome(options=options, service=service)
        driver.set_page_load_timeout(self.time_limit_s)
        driver.set_script_timeout(self.time_limit_s)
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": self.viewport[0], "height": self.viewport[1], "deviceScaleFactor": 1, "mobile": False})
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _QUIET_DIALOGS})
        self._driver = driver

    def _kill(self):
        driver, self._driver = self._driver, None
        if driver is not None:
            process = driver.service.process
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, AttributeError):
                pass
            try:
                process.wait(timeout=5)
            except Exception:  # noqa: BLE001 — best effort: the group is already killed
                pass
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None
        release, self._release_memory_bound = self._release_memory_bound, lambda: None
        release()

    def _load(self, url: str) -> None:
        """Navigate to `url` and return once the window shows its origin with the load event fired (readyState
        'complete'), or raise PageNotLoadedError at the page's time limit. chromedriver's `get` alone is not
        enough: with Chromium 150 on a loaded host it has returned before the page loaded (a page measured at
        the blank page's 800 px, another without its picture) and raised its own 'timeout' 2 s into a 15 s limit,
        its browser's start included; both mean only that the page is not there yet."""
        driver, deadline = self._driver, time.monotonic() + self.time_limit_s
        host = page_host(url)
        try:
            driver.get(url)
        except lazy.selenium_timeout():
            if time.monotonic() >= deadline:
                raise
        while (state := driver.execute_script(_PAGE_STATE)) != [host, "complete"]:
            if time.monotonic() >= deadline:
                raise PageNotLoadedError(f"the page had not loaded after {self.time_limit_s:g} s (the window shows "
                                         f"{state[0][:80]!r}, readyState {state[1]!r})")
            time.sleep(0.02)

    def _screenshot(self, url: str) -> bytes:
        driver = self._driver
        self._load(url)
        metrics = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})
        content = metrics.get("cssContentSize") or metrics["contentSize"]
        width, height = screenshot_clip(content["width"], content["height"], self.viewport, self.max_height)
        for attempt in range(CAPTURE_ATTEMPTS):
            shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True, "fromSurface": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
            size = _png_size(shot["data"])
            if size == (width, height):
                break
            # Once in CI, on a loaded host: a page cut at 3000 px came back 800 px high, the viewport's height.
            log.warning("the browser returned a %dx%d screenshot for a %dx%d clip (attempt %d of %d)",
                        *size, width, height, attempt + 1, CAPTURE_ATTEMPTS)
        else:
            raise ScreenshotSizeError(f"the browser returned a {size[0]}x{size[1]} screenshot for a {width}x{height} "
                                      f"clip {CAPTURE_ATTEMPTS} times")
        # Back to a blank page and one window, so nothing of this page lives on into the next.
        handles = driver.window_handles
        for handle in handles[1:]:
            driver.switch_to.window(handle)
            driver.close()
        driver.switch_to.window(handles[0])
        driver.get("about:blank")
        # The tab's session history would hand the next page this one (history.length, history.back(), whose
        # page the back-forward cache may even keep alive): the blank page is its only entry.
        driver.execute_cdp_cmd("Page.resetNavigationHistory", {})
        driver.execute_script("window.name = '';")  # the one thing a browsing context carries across origins
        if len(shot["data"]) > MAX_SCREENSHOT_BYTES * 4 // 3 + 4:  # base64: refused before it is decoded
            raise ScreenshotTooLargeError(f"the page's screenshot is about {len(shot['data']) * 3 // 4} bytes, more "
                                          f"than {MAX_SCREENSHOT_BYTES} (browser.MAX_SCREENSHOT_BYTES)")
        return checked_screenshot(base64.b64decode(shot["data"]))

    def render(self, html: str) -> Render:
        """Screenshot of `html`; never raises: a failed page is Render(None, error). A page whose browser failed
        fast (within half the time limit, e.g. chromedriver's own 'timeout' on a loaded host) is tried once more
        on a fresh browser; one that ran into the time limit is not."""
        start = time.monotonic()
        url = self.server.add(html)
        try:
            for attempt in range(2):
                began = time.monotonic()
                try:
                    if self._driver is None:
                        self._start()
                    future = self._worker.submit(self._screenshot, url)
                    png = future.result(timeout=self.time_limit_s + 5)
                    return Render(png, None, time.monotonic() - start)
                except ScreenshotTooLargeError as e:  # the browser is fine and already back on a blank page
                    return Render(None, str(e), time.monotonic() - start)
                except Exception as e:  # noqa: BLE001 — any failure (timeout, crash) loses this page, not the run
                    reason = "time limit" if isinstance(e, concurrent.futures.TimeoutError) else type(e).__name__
                    self._restart(reason, e)
                    if attempt == 0 and time.monotonic() - began < self.time_limit_s / 2:
                        continue
                    return Render(None, f"{reason}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300],
                                  time.monotonic() - start)
        finally:
            self.server.remove(url)

    def _restart(self, reason: str, error: Exception) -> None:
        log.warning("page did not render (%s: %s); restarting the browser", reason, str(error).splitlines()[:1])
        self._kill()
        self.restarts += 1
        # The stuck worker thread returns once its browser is gone; a fresh one serves the next page.
        self._worker.shutdown(wait=False)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="renderer")

    def close(self):
        self._kill()
        self._worker.shutdown(wait=False)


class RendererPool:
    """`size` browsers rendering pages in parallel behind one proxy. `render_many` keeps the input order."""

    def __init__(self, size: int = 2, **renderer_kwargs):
        self.server = PageServer()
        self.renderers = [Renderer(self.server, **renderer_kwargs) for _ in range(size)]
        self._free: queue.Queue[Renderer] = queue.Queue()
        for renderer in self.renderers:
            self._free.put(renderer)
        self._threads = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="render-pool")

    def render(self, html: str) -> Render:
        renderer = self._free.get()
        try:
            return renderer.render(html)
        finally:
            self._free.put(renderer)

    def render_many(self, pages: Sequence[str | None]) -> list[Render]:
        """One Render per page; None (no HTML in the reply) gives Render(None, 'no html')."""
        def one(html):
            return self.render(html) if html is not None else Render(None, "no html")
        return list(self._threads.map(one, pages))

    def close(self):
        for renderer in self.renderers:
            renderer.close()
        self._threads.shutdown(wait=False)
        self.server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
