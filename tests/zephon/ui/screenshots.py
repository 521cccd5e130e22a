"""Screenshots of each page of ``zephon ui`` for docs/ui.md, taken in headless chromium over
a catalog filled by real runs (``filled.py``): ``python -m tests.zephon.ui.screenshots
docs/images`` rewrites docs/images/ui-*.png; the browser tests take the same ones into a
temporary directory, so this script keeps working."""

from __future__ import annotations

import os

#: page -> (URL path, file name) of each screenshot in docs/
PAGES = {
    "runs": ("/runs?refresh=0", "ui-runs.png"),
    "run": ("/runs/alpha?refresh=0", "ui-run.png"),
}


def charts_drawn(page) -> None:
    """Wait until every chart of the page is drawn: an SVG with at least one series, laid
    out by the browser (a box of non-zero size)."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-chart]')].every((n) => {"
        " const svg = n.querySelector('svg'); const box = svg && svg.getBoundingClientRect();"
        " return box && box.width > 0 && box.height > 0 && n.querySelector('.series'); })",
        timeout=20_000,
    )


def shoot(context, base: str, directory: str) -> list[str]:
    """Screenshot every page of ``PAGES`` served at ``base`` into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    written = []
    page = context.new_page()
    try:
        for name, (path, file_name) in PAGES.items():
            page.goto(base + path)
            if name == "run":
                charts_drawn(page)
            target = os.path.join(directory, file_name)
            page.screenshot(path=target, full_page=True)
            written.append(target)
    finally:
        page.close()
    return written


def main(directory: str) -> None:
    import tempfile

    from playwright.sync_api import sync_playwright

    from tests.zephon.ui.conftest import CHROMIUM_FLAGS, start, stop
    from tests.zephon.ui.filled import fill

    with tempfile.TemporaryDirectory() as root:
        url = fill(root)
        process, base = start(["--catalog", url, "--port", "0"])
        try:
            with sync_playwright() as playwright:
                context = playwright.chromium.launch_persistent_context(
                    os.path.join(root, "profile"),
                    executable_path="/usr/bin/chromium",
                    headless=True,
                    args=CHROMIUM_FLAGS,
                    viewport={"width": 1200, "height": 900},
                )
                try:
                    for path in shoot(context, base, directory):
                        print(path, os.path.getsize(path), "bytes")
                finally:
                    context.close()
        finally:
            stop(process)


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
