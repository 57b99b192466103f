#!/usr/bin/env python3
"""Open a ``fedtier report`` page in headless Chromium, take a screenshot, and check that every plot loaded.

    .venv/bin/python scripts/report_screenshot.py runs/quickstart/report.html [--out shot.png]

Exit 0 when every ``<img>`` of the page decoded to a non-empty picture in the browser and the screenshot
is not blank; 1 otherwise; 2 when Chromium is missing. scripts/setup.sh installs Debian's ``chromium`` when run
as root; elsewhere point ``CHROMIUM`` at a Chrome/Chromium binary.

How: a copy of the page gets a small script that, on the load event (every image loaded or failed),
writes the count of images that loaded (``naturalWidth > 0``) into the DOM, which ``--dump-dom`` prints.
A second Chromium run takes the screenshot.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]
PROBE = """<script>
window.addEventListener("load", () => {  // fires once every image loaded or failed
  const imgs = Array.from(document.images);
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0);
  const p = document.createElement("pre");
  p.id = "fedtier-probe";
  p.textContent = `images-loaded ${ok.length}/${imgs.length} ` +
    imgs.filter(i => !ok.includes(i)).map(i => i.alt).join(",");
  document.body.appendChild(p);
});
</script>"""


@dataclass
class BrowserCheck:
    """What Chromium saw: images in the page, how many loaded, which did not, the screenshot."""

    total: int
    loaded: int
    failed: list[str]
    screenshot: Path | None
    blank: bool

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.loaded == self.total and not self.blank


def find_chromium() -> str | None:
    """``$CHROMIUM``, else chromium / chromium-browser / google-chrome on the PATH."""
    env = os.environ.get("CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _chromium(binary: str, profile: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout
    )


def check_report(
    html: str | Path,
    screenshot: str | Path | None,
    *,
    chromium: str | None = None,
    width: int = 1200,
    timeout: float = 120.0,
) -> BrowserCheck:
    """Render ``html`` in headless Chromium (a fresh profile each run) and, unless ``screenshot`` is None,
    take a screenshot to that PNG; raise ``RuntimeError`` when Chromium fails."""
    binary = chromium or find_chromium()
    if binary is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium; or set CHROMIUM)")
    html = Path(html).resolve()
    screenshot = Path(screenshot).resolve() if screenshot is not None else None
    page = html.read_text(encoding="utf-8")
    images = len(re.findall(r"<img\b", page))
    with tempfile.TemporaryDirectory(prefix="fedtier-chromium-") as tmp:
        probe = Path(tmp) / "page.html"
        probe.write_text(
            page.replace("</body>", PROBE + "</body>") if "</body>" in page else page + PROBE, encoding="utf-8"
        )
        dom = _chromium(binary, Path(tmp) / "profile-dom", "--dump-dom", probe.as_uri(), timeout=timeout)
        found = re.search(r"images-loaded (\d+)/(\d+) ?([^<]*)", dom.stdout)
        if found is None:
            raise RuntimeError(f"chromium printed no probe result (exit {dom.returncode}): {dom.stderr[-1000:]}")
        if screenshot is not None:
            # tall enough for every plot (each at most ~600 px at this width) plus the summary table
            height = 400 + 650 * max(1, images)
            shot = _chromium(
                binary,
                Path(tmp) / "profile-shot",
                f"--screenshot={screenshot}",
                f"--window-size={width},{height}",
                html.as_uri(),
                timeout=timeout,
            )
            if not screenshot.exists():
                raise RuntimeError(f"chromium wrote no screenshot (exit {shot.returncode}): {shot.stderr[-1000:]}")
    loaded, total = int(found.group(1)), int(found.group(2))
    return BrowserCheck(
        total,
        loaded,
        [a for a in found.group(3).strip().split(",") if a],
        screenshot,
        blank=screenshot is not None and _blank(screenshot),
    )


def _blank(png: Path) -> bool:
    """True when the screenshot is one flat colour (nothing rendered)."""
    from matplotlib.image import imread

    pixels = imread(png)
    return float(pixels[..., :3].std()) < 1e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, help="a report.html written by fedtier report")
    parser.add_argument("--out", type=Path, help="screenshot PNG (default: next to the page, *_screenshot.png)")
    parser.add_argument("--width", type=int, default=1200)
    args = parser.parse_args(argv)
    out = args.out or args.html.with_name(args.html.stem + "_screenshot.png")
    try:
        result = check_report(args.html, out, width=args.width)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{result.loaded}/{result.total} plots loaded in Chromium; screenshot {result.screenshot}"
        + (" (blank!)" if result.blank else "")
        + (f"; failed: {', '.join(result.failed)}" if result.failed else "")
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
