"""Headless Chromium (Debian's ``chromium``, `make browser`) driven by playwright, for the page at /."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = os.environ.get("PGROUPS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("PGROUPS_ARTIFACTS", Path(__file__).parents[1] / "artifacts"))
# no network beyond the server: Chromium's own background connections are refused here
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def chromium() -> Iterator[object]:
    """A fresh browser profile; yields a playwright BrowserContext."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing: run `make browser` (Debian's chromium)")
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        # bypass_csp: the tests' own wait_for_function evaluates strings, which the page's policy
        # refuses; it also means the markup test holds the rendering safe without the policy's help
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                   viewport={"width": 1280, "height": 800}, bypass_csp=True)
        try:
            yield ctx
        finally:
            ctx.close()


def screenshot(page: object, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path))
    return path
