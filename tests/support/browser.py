"""Headless Chromium (Debian's package) driven by Playwright, for the report pages' browser tests.

Playwright never downloads a browser here: it drives the system's ``chromium``. Where either is missing the
tests are skipped with the reason; the README's set-up (``make test``) installs both where it can.
"""

import os
import shutil
from pathlib import Path

import pytest

FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_or_skip() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[dev]' (make test does)")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no chromium on PATH: apt-get install chromium (make test does where it may run apt-get)")
    return exe


class Opened:
    """A page loaded from a file, with everything that went wrong while it loaded and ran."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.problems: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page.on(
            "console", lambda m: self.problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
        )
        self.page.on("pageerror", lambda e: self.problems.append(f"pageerror: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.url = Path(path).resolve().as_uri()
        self.page.goto(self.url)
        self.page.wait_for_load_state("load")

    def hover_middle(self, chart_id: str) -> str:
        """Move the mouse to the middle of a chart; the text of its hover box."""
        over = self.page.locator(f"#{chart_id} .u-over")
        over.scroll_into_view_if_needed()
        box = over.bounding_box()
        self.page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        return self.page.inner_text(f"#{chart_id}-hover")

    def screenshot(self, name: str, tmp_path: Path, selector: str | None = None) -> Path:
        """A screenshot of the window (or of one element) in ``tmp_path``, and in ``$MEMFIT_SCREENSHOTS`` when set:
        how docs/images is made."""
        out = tmp_path / f"{name}.png"
        if selector:
            self.page.locator(selector).screenshot(path=str(out))
        else:
            self.page.screenshot(path=str(out))
        if os.environ.get("MEMFIT_SCREENSHOTS"):
            shutil.copy(out, Path(os.environ["MEMFIT_SCREENSHOTS"]) / out.name)
        return out

    def assert_clean(self) -> None:
        """No console error or warning, no script error, no dialog, no request but the page itself."""
        assert self.problems == [] and self.dialogs == []
        assert [u for u in self.requests if u != self.url] == []
