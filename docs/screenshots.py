"""Screenshots of the Polyaxon UI for docs/polyaxon.md, taken from `make polyaxon-demo KEEP=1`.

    python docs/screenshots.py            # about 3 min: the demo, then 5 pages in headless Chromium

Not part of the tests (it needs Debian's `chromium`: apt-get install chromium). It starts the
demo as the README writes it, reads the run pages it prints, takes each page with headless
Chromium (the UI is a single-page app: a virtual-time budget lets it fetch and draw), writes
docs/images/polyaxon-*.png, and stops the demo with Ctrl-C (SIGINT).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
PAGES = {  # file name -> (the part of a run's page after /runs/<uuid>, the window's height)
    "polyaxon-runs": (None, 420),             # the project's runs list: names, statuses
    "polyaxon-overview": ("", 2000),          # the original run: status, inputs, outputs (first_params, goodput)
    "polyaxon-statuses": ("/statuses", 2150),  # stopped (Exit75), resuming, succeeded
    "polyaxon-dashboards": ("/dashboards", 640),  # its metrics (the timeline's section opens on a click)
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
    finally:
        pid = re.search(r"or kill (\d+)", "".join(lines))
        os.kill(int(pid.group(1)), signal.SIGINT) if pid else os.killpg(demo.pid, signal.SIGTERM)
        demo.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
