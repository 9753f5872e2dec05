"""Screenshots of the Polyaxon UI for docs/polyaxon.md, taken from `make polyaxon-demo KEEP=1`.

    python docs/screenshots.py            # about 3 min: the demo, then 5 pages in headless Chromium

Not part of the tests (it needs Debian's `chromium`: apt-get install chromium). It starts the
demo as the README writes it, reads the run pages it prints, takes each page with headless
Chromium (the UI is a single-page app: a virtual-time budget lets it fetch and draw), writes
docs/images/polyaxon-*.png, and stops the demo with Ctrl-C (SIGINT). The recovery timeline sits
in the dashboard's collapsed "image events" section: that one is opened with a click, driven
over Chromium's DevTools protocol (websocket-client, installed with polyaxon).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import base64
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
PAGES = {  # file name -> (the part of a run's page after /runs/<uuid>, the window's height)
    "polyaxon-runs": (None, 420),             # the project's runs list: names, statuses
    "polyaxon-overview": ("", 2000),          # the original run: status, inputs, outputs (first_params, goodput)
    "polyaxon-statuses": ("/statuses", 2150),  # stopped (Exit75), resuming, succeeded
    "polyaxon-dashboards": ("/dashboards", 640),  # its metrics
    "polyaxon-copy": ("copy", 2000),          # the copy: copied_from, newest_generation, its lineage
}


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    raise SystemExit("screenshots: no chromium; apt-get install chromium")


def shoot(browser: str, url: str, target: Path, height: int) -> None:
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1440,{height}", "--virtual-time-budget=15000", f"--screenshot={target}", url],
                   check=True, capture_output=True, timeout=120)
    print(f"{target.relative_to(REPO)}  <- {url}")


SECTION = """[...document.querySelectorAll('[data-rfd-draggable-id^="section-"]')].find(
    e => e.querySelector('button') && e.innerText.trim().startsWith(%s))"""
OPEN_SECTION = """(() => {
  const section = %s;
  const expand = section && section.querySelector('button[title="Expand section"]');
  if (!expand) return false;
  expand.click();
  return true;
})()"""
SHOWN = """(() => {
  const section = %s;
  section.scrollIntoView({block: 'start'});
  const images = [...section.querySelectorAll('img')];
  return images.length > 0 && images.every(i => i.complete && i.naturalWidth > 0);
})()"""


class DevTools:
    """One headless Chromium page driven over the DevTools protocol: open, click, shoot."""

    def __init__(self, browser: str, width: int, height: int, port: int = 9333):
        import websocket  # websocket-client, a dependency of polyaxon

        self.process = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu",
                                         "--hide-scrollbars", f"--window-size={width},{height}",
                                         f"--remote-debugging-port={port}", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2) as answer:
                    page = next(t for t in json.load(answer) if t["type"] == "page")
                break
            except (OSError, StopIteration):
                if time.monotonic() > deadline:
                    raise SystemExit("screenshots: chromium's DevTools port never answered")
                time.sleep(0.3)
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.calls = 0

    def call(self, method: str, **params) -> dict:
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self.calls:
                if "error" in message:
                    raise SystemExit(f"screenshots: {method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for_text(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"document.body && document.body.innerText.includes({json.dumps(text)})"):
            if time.monotonic() > deadline:
                raise SystemExit(f"screenshots: the page never showed {text!r}")
            time.sleep(0.5)

    def shoot(self, target: Path) -> None:
        target.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(30)


def shoot_section(browser: str, url: str, target: Path, section: str, height: int) -> None:
    """The page at `url` with its collapsed `section` expanded by a click, scrolled to it once
    its images are drawn."""
    page = DevTools(browser, 1440, height)
    found = SECTION % json.dumps(section)
    try:
        page.call("Page.enable")
        page.call("Page.navigate", url=url)
        page.wait_for_text(section)
        if not page.evaluate(OPEN_SECTION % found):
            raise SystemExit(f"screenshots: no {section!r} section to expand at {url}")
        deadline = time.monotonic() + 60
        while not page.evaluate(SHOWN % found):
            if time.monotonic() > deadline:
                raise SystemExit(f"screenshots: the {section!r} section at {url} drew no image")
            time.sleep(0.5)
        time.sleep(1)  # the scroll settles
        page.shoot(target)
        print(f"{target.relative_to(REPO)}  <- {url} ({section}, expanded)")
    finally:
        page.close()


def main() -> int:
    browser = chromium()
    IMAGES.mkdir(parents=True, exist_ok=True)
    demo = subprocess.Popen(["make", "polyaxon-demo", "KEEP=1"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in demo.stdout:
            sys.stdout.write(line)
            lines.append(line)
            if line.startswith("stop: Ctrl-C"):
                break
        text = "".join(lines)
        pages = re.findall(r"(http://127\.0\.0\.1:\d+/ui/default/[\w-]+/runs)/([0-9a-f]{32})", text)
        if len(pages) != 2:
            raise SystemExit(f"screenshots: the demo printed no run pages:\n{text[-2000:]}")
        (runs, original), (_, copy) = pages
        for name, (part, height) in PAGES.items():
            url = runs if part is None else f"{runs}/{copy}" if part == "copy" else f"{runs}/{original}{part}"
            shoot(browser, url, IMAGES / f"{name}.png", height)
        shoot_section(browser, f"{runs}/{original}/dashboards", IMAGES / "polyaxon-timeline.png", "image events", 900)
    finally:
        pid = re.search(r"or kill (\d+)", "".join(lines))
        os.kill(int(pid.group(1)), signal.SIGINT) if pid else os.killpg(demo.pid, signal.SIGTERM)
        demo.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
