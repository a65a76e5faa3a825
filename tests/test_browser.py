"""The frontend renderer: real headless Chromium screenshots, and hostile pages kept inside the browser.

Every hostile page turns its own background red if an attempt succeeds, so containment is checked on the pixels
as well as on a canary server that must never see a request.
"""
import http.server
import io
import threading

import numpy as np
import psutil
import pytest
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from sweet_jax.envs.browser import PLACEHOLDER_URL, RendererPool, placeholder_png
from sweet_jax.envs.clip_reward import clip_pixels

TIME_LIMIT_S = 15.0   # a page takes under a second idle; a loaded CI host has been seen to take 8x that
MAX_HEIGHT = 3000


@pytest.fixture(scope="module")
def pool():
    with RendererPool(1, time_limit_s=TIME_LIMIT_S, max_height=MAX_HEIGHT) as pool:
        yield pool


@pytest.fixture(scope="module")
def canary():
    """A server on the host that answers 200 with a red page; a contained page never reaches it."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            body = b"<body style='background:#ff0000'>reached</body>"
            self.send_response(200)
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()


def pixels(render):
    assert render.png is not None, render.error
    return np.asarray(Image.open(io.BytesIO(render.png)).convert("RGB"))


def red_pixels(render) -> int:
    rgb = pixels(render).astype(int)
    return int(((rgb[..., 0] > 200) & (rgb[..., 1] < 60) & (rgb[..., 2] < 60)).sum())


# Succeeding attempts paint the page red: a synchronous request finishes before the load event (and so before
# the screenshot), so the result is on the page when it is captured.
REDDEN_IF_READ = """
<script>
function tryRead(url) {
  try { const x = new XMLHttpRequest(); x.open('GET', url, false); x.send();
        if (x.status === 200 || (x.status === 0 && x.responseText)) document.body.style.background = '#ff0000';
  } catch (e) {}
}
</script>"""


def test_known_page_renders_to_known_size_and_colours(pool):
    html = ("<html><body style='margin:0'><div style='width:100%;height:1500px;background:rgb(0,0,255)'></div>"
            f"<img src='{PLACEHOLDER_URL}' style='display:block'></body></html>")
    render = pool.render(html)
    rgb = pixels(render)
    assert render.size == (1280, 1800)  # fixed 1280-wide viewport; full page = 1500 px div + 300 px picture
    assert tuple(rgb[10, 10]) == (0, 0, 255)
    placeholder = np.asarray(Image.open(io.BytesIO(placeholder_png())).convert("RGB"))
    np.testing.assert_array_equal(rgb[1500:1800, 0:400], placeholder)


def test_pages_reach_no_network_and_no_host_port(pool, canary):
    address, hits = canary
    html = f"""<html><body style='background:#ffffff'>{REDDEN_IF_READ}
      <img src='http://{address}/img.png'> <iframe src='http://{address}/frame'></iframe>
      <iframe src='http://localhost:{address.split(':')[1]}/frame2'></iframe>
      <link rel=stylesheet href='http://{address}/style.css'>
      <script src='http://{address}/script.js'></script>
      <script>
        tryRead('http://{address}/xhr'); tryRead('https://example.com/'); tryRead('http://example.com/');
        try {{ new WebSocket('ws://{address}/ws'); }} catch (e) {{}}
        try {{ navigator.sendBeacon('http://{address}/beacon', 'x'); }} catch (e) {{}}
        fetch('http://{address}/fetch').then(() => document.body.style.background = '#ff0000', () => {{}});
      </script></body></html>"""
    render = pool.render(html)
    assert red_pixels(render) == 0
    assert hits == []
    assert any(address in line for line in pool.server.refused)  # the attempts were made, and refused


def test_pages_read_no_file(pool, tmp_path):
    secret = tmp_path / "secret.html"
    secret.write_text("<body style='background:#ff0000'>secret</body>")
    url = secret.as_uri()
    html = f"""<html><body style='background:#ffffff'>{REDDEN_IF_READ}
      <iframe src='{url}' style='width:600px;height:400px'></iframe>
      <img src='{url}'> <object data='{url}' width=300 height=300></object>
      <script>tryRead('{url}'); tryRead('file:///etc/passwd');</script></body></html>"""
    render = pool.render(html)
    assert red_pixels(render) == 0


def test_an_endless_script_loses_its_page_and_the_next_page_renders(pool):
    restarts = pool.renderers[0].restarts
    render = pool.render("<html><body><script>while (true) {}</script></body></html>")
    assert render.png is None and render.error
    assert pool.renderers[0].restarts == restarts + 1
    after = pool.render("<body style='margin:0;background:rgb(0,128,0)'><div style='height:10px'></div></body>")
    assert tuple(pixels(after)[5, 5]) == (0, 128, 0)


def test_a_huge_page_is_cut_at_the_maximum_height(pool):
    render = pool.render("<body style='margin:0'><div style='height:5000000px;width:50000px;"
                         "background:#0000ff'></div></body>")
    assert render.png is not None, render.error
    width, height = render.size
    assert height == MAX_HEIGHT and width <= 4 * 1280


def test_nothing_of_a_page_reaches_the_next_one(pool):
    """window.name survives navigations in a browsing context: the renderer clears it between pages."""
    pool.render("<body><script>window.name = 'secret from the last page';</script></body>")
    after = pool.render("<body style='margin:0;background:#ffffff'><script>if (window.name) "
                        "document.body.style.background = '#ff0000';</script><div style='height:10px'></div></body>")
    assert red_pixels(after) == 0


def test_the_last_pages_history_does_not_reach_the_next_one(pool):
    """A page sees a history of two entries, the blank page and itself, never the pages rendered before it (whose
    pixels history.back() would bring back, perhaps from the back-forward cache)."""
    pool.render("<body style='margin:0;background:#ff0000'><div style='height:50px'>the page before</div></body>")
    after = pool.render("<body style='margin:0;background:#ffffff'><script>if (history.length > 2) "
                        "document.body.style.background = '#ff0000';</script><div style='height:10px'></div></body>")
    assert red_pixels(after) == 0
    assert red_pixels(pool.render("<body style='margin:0;background:#ffffff'><script>if (history.length > 1) "
                                  "document.body.style.background = '#ff0000';</script>"
                                  "<div style='height:10px'></div></body>")) > 0   # the control: the check sees it


def test_popups_and_dialogs_do_nothing(pool, canary):
    address, hits = canary
    html = f"""<html><body style='background:#ffffff;margin:0'><div style='height:50px'>page</div><script>
      for (let i = 0; i < 20; i++) window.open('http://{address}/popup' + i);
      alert('a'); confirm('b'); prompt('c'); print();
      const f = document.createElement('iframe'); document.body.appendChild(f);
      try {{ f.contentWindow.alert('from a fresh frame'); f.contentWindow.open('http://{address}/p'); }} catch (e) {{}}
      </script></body></html>"""
    render = pool.render(html)
    assert red_pixels(render) == 0 and hits == []
    assert len(pool.renderers[0]._driver.window_handles) == 1
    assert pool.render("<p>next</p>").png is not None


def test_pool_renders_in_order_and_close_leaves_no_browser():
    pool = RendererPool(2, time_limit_s=TIME_LIMIT_S)
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    pages = [f"<body style='margin:0;background:rgb{c}'></body>" for c in colours] + [None]
    renders = pool.render_many(pages)
    assert [tuple(pixels(r)[0, 0]) for r in renders[:3]] == colours
    assert renders[3].png is None and renders[3].error == "no html"
    drivers = [psutil.Process(r._driver.service.process.pid) for r in pool.renderers]
    children = drivers + [c for d in drivers for c in d.children(recursive=True)]
    assert sum("chrom" in p.name() for p in children) > 2  # each driver with its browser processes
    pool.close()
    alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_clip_pixels_of_a_real_screenshot_match_clip_processor(pool):
    html = ("<html><body style='font-family:sans-serif;margin:20px'><h1 style='color:#1a5'>Bakery</h1>"
            "<p>Fresh bread every morning.</p>" + "<div style='height:200px;background:#fc3;margin:8px'>box</div>" * 6
            + f"<img src='{PLACEHOLDER_URL}'></body></html>")
    screenshot = pool.render(html).png
    expected = CLIPImageProcessorPil()(images=Image.open(io.BytesIO(screenshot)), return_tensors="np")
    np.testing.assert_allclose(clip_pixels(screenshot), expected["pixel_values"][0].transpose(1, 2, 0), atol=1e-5)
