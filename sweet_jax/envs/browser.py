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
  started afresh. `window.open`, `alert`, `confirm`, `prompt` and `print` do nothing; any window a page still
  manages to open is closed after the render.
- Full-page screenshots have a fixed viewport (`VIEWPORT`, CSS pixels at scale 1) and are cut at
  `MAX_PAGE_HEIGHT` so a page of a million pixels cannot exhaust memory.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import http.server
import io
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import socketserver
import tempfile
import threading
import time
from typing import Sequence

from PIL import Image

from sweet_jax.data.frontend import MAX_PLACEHOLDER_SIDE, PLACEHOLDER_HOST, placeholder_url
from sweet_jax.errors import SweetJaxError

log = logging.getLogger(__name__)

VIEWPORT = (1280, 800)         # (width, height) in CSS pixels: a common laptop screen, fixed for every page
MAX_PAGE_HEIGHT = 8000         # full-page screenshots are cut here
PAGE_TIME_LIMIT_S = 15.0       # load + layout + screenshot of one page
PLACEHOLDER_URL = placeholder_url(400, 300)   # what tests and demo pages show

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--disable-extensions", "--disable-default-apps", "--mute-audio",
    "--hide-scrollbars", "--force-device-scale-factor=1", "--dns-prefetch-disable",
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # no name resolves; the proxy is an address
    "--proxy-bypass-list=<-loopback>",         # loopback goes through the proxy too, which refuses it
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
        self.pages: dict[str, bytes] = {}          # host -> HTML
        self.refused: list[str] = []               # request lines refused (for tests and logs)
        self._lock = threading.Lock()
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
                    server.refused.append(self.requestline)
                self._send(403, "text/plain", b"")

            do_HEAD = do_GET  # noqa: N815
            do_POST = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = do_CONNECT = _refuse  # noqa: N815

            def log_message(self, *args):
                pass

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

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
        self.pages.pop(url.removeprefix("http://").rstrip("/"), None)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


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
                 max_height: int = MAX_PAGE_HEIGHT):
        self.server, self.viewport, self.time_limit_s, self.max_height = server, viewport, time_limit_s, max_height
        self.browser, self.driver_path = find_browser()
        self._driver = None
        self._profile = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="renderer")
        self.restarts = 0

    def _start(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

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
        # Own session: a hung browser is killed with its whole process group.
        service = Service(self.driver_path, log_output=os.devnull, popen_kw={"start_new_session": True})
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

    def _screenshot(self, url: str) -> bytes:
        import base64

        driver = self._driver
        driver.get(url)
        metrics = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})
        content = metrics.get("cssContentSize") or metrics["contentSize"]
        width = max(self.viewport[0], min(int(content["width"]), self.viewport[0] * 4))
        height = max(self.viewport[1], min(int(content["height"]), self.max_height))
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True, "fromSurface": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
        # Back to a blank page and one window, so nothing of this page lives on into the next.
        handles = driver.window_handles
        for handle in handles[1:]:
            driver.switch_to.window(handle)
            driver.close()
        driver.switch_to.window(handles[0])
        driver.get("about:blank")
        return base64.b64decode(shot["data"])

    def render(self, html: str) -> Render:
        """Screenshot of `html`; never raises: a failed page is Render(None, error)."""
        start = time.monotonic()
        url = self.server.add(html)
        try:
            if self._driver is None:
                self._start()
            future = self._worker.submit(self._screenshot, url)
            png = future.result(timeout=self.time_limit_s + 5)
            return Render(png, None, time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 — any failure (timeout, crash) loses this page, not the run
            reason = "time limit" if isinstance(e, concurrent.futures.TimeoutError) else type(e).__name__
            log.warning("page did not render (%s: %s); restarting the browser", reason, str(e).splitlines()[:1])
            self._kill()
            self.restarts += 1
            # The stuck worker thread returns once its browser is gone; a fresh one serves the next page.
            self._worker.shutdown(wait=False)
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="renderer")
            return Render(None, f"{reason}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300],
                          time.monotonic() - start)
        finally:
            self.server.remove(url)

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
