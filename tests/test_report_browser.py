"""The HTML report renders every plot in a real browser (headless Chromium: scripts/setup.sh installs Debian's
chromium when run as root; skipped where it is absent)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from monitor.report import write_report
from sim.launcher import run_simulation
from tests.conftest import beside, small_config

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "report_screenshot.py"
spec = importlib.util.spec_from_file_location("report_screenshot", SCRIPT)
shot = sys.modules["report_screenshot"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shot)  # type: ignore[union-attr]
pytestmark = pytest.mark.skipif(shot.find_chromium() is None, reason="chromium is not installed")


def test_headless_chromium_renders_every_plot_of_the_report(tmp_path: Path) -> None:
    result = run_simulation(small_config(tmp_path, run={"rounds": 2}))
    html, plots = write_report([result.output_dir], tmp_path / "report.html")
    # and a copy whose first plot's PNG is corrupt, checked beside it (each Chromium its own process and profile)
    page = html.read_text()
    broken = tmp_path / "broken.html"
    first = plots[0].name
    broken.write_text(re.sub(rf'(<img alt="{first}" src="data:image/png;base64,)[^"]+', r"\1AAAA", page, count=1))
    check, bad = beside(lambda: shot.check_report(html, tmp_path / "shot.png"), lambda: shot.check_report(broken, None))
    assert check.total == len(plots) >= 5
    assert check.loaded == check.total and check.failed == [] and not check.blank and check.ok
    assert check.screenshot is not None and check.screenshot.stat().st_size > 10_000

    # the plot whose PNG is corrupt is caught, by its name
    assert bad.total == len(plots) and bad.loaded == len(plots) - 1 and bad.failed == [first] and not bad.ok
