"""Fake HTTP peers for the tests: a handler class served on 127.0.0.1 while a `with` block holds it, and the
writer that sends an answer whole or a byte at a time (a slow peer)."""
from __future__ import annotations

import http.server
import threading
import time


class LocalServer:
    """`handler` (a BaseHTTPRequestHandler class) on 127.0.0.1 at a free port, in a daemon thread from `with` (or
    start() to close()); url: its OpenAI-style base URL (http://127.0.0.1:PORT/v1)."""

    def __init__(self, handler):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def start(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


class QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


def write(wfile, data: bytes, drip_s: float = 0.0) -> None:
    """`data` at once, or a byte every `drip_s` seconds; a client that left is no error."""
    try:
        if not drip_s:
            wfile.write(data)
            return
        for i in range(len(data)):
            wfile.write(data[i:i + 1])
            wfile.flush()
            time.sleep(drip_s)
    except (BrokenPipeError, ConnectionResetError):
        pass
