"""A throttling S3 front on loopback: forwards every request to a real S3 server (the suite's
SeaweedFS) and answers `503 SlowDown` to requests above `rate` a second, as S3 does to a burst
above a prefix partition's rate until it repartitions (issue 58, docs/object-store.md).

The client signs for the proxy's host; the proxy passes the Host header on unchanged, so the
server checks the same signature. Bodies are read whole (test-sized objects).
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that hung up (it timed out and retried): nothing to report."""


class ThrottlingProxy:
    """`with ThrottlingProxy(upstream_port, rate) as proxy:` proxy.endpoint_url is the S3 endpoint."""

    def __init__(self, upstream_port: int, rate: int):
        self.upstream_port, self.rate = upstream_port, rate
        self.lock = threading.Lock()
        self.window, self.in_window = 0, 0
        self.forwarded, self.throttled = 0, 0
        self.server = QuietServer(("127.0.0.1", 0), self.handler())
        self.thread = threading.Thread(target=self.server.serve_forever, name="throttle-proxy", daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def admit(self) -> bool:
        """At most `rate` requests in each wall-clock second; the rest are throttled."""
        with self.lock:
            second = int(time.monotonic())
            if second != self.window:
                self.window, self.in_window = second, 0
            self.in_window += 1
            if self.in_window > self.rate:
                self.throttled += 1
                return False
            self.forwarded += 1
            return True

    def handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # the suite's output stays the trainer's
                pass

            def relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if not proxy.admit():
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {key: value for key, value in self.headers.items() if key.lower() not in HOP_BY_HOP}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

        return Handler

    def __enter__(self) -> "ThrottlingProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
