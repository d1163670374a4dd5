"""A real browser for the page tests: Debian's ``chromium``, headless, driven through its ``chromedriver``.

Both come from the Debian packages ``chromium`` and ``chromium-driver`` (``make tools`` installs them, as the
Prometheus binaries). Outside CI a missing binary skips the test; in CI (``CI=true``) it fails it, so the
browser tests cannot quietly stop running. Selenium is pointed at those binaries: it never downloads one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from .promtool import in_ci

T = TypeVar("T")

#: Where the tests save their screenshots (test artefacts; the README's pictures are copied from here).
ARTEFACTS = Path(__file__).parents[2] / "build" / "screenshots"

#: The PNG ``tEXt`` keyword under which a published picture keeps the digest of what it shows.
DIGEST_KEYWORD = b"dramatiq-leases-content"


def _binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    problem = f"{names[0]} is not on PATH (apt-get install chromium chromium-driver, or make tools as root)"
    if in_ci():
        pytest.fail(problem)
    pytest.skip(problem)


@contextmanager
def chromium(width: int = 1100, height: int = 800) -> Iterator[Any]:
    """A headless chromium WebDriver (``selenium.webdriver.Chrome``), quit at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _binary("chromium", "chromium-browser")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={width},{height}")
    driver = webdriver.Chrome(service=Service(executable_path=_binary("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, name: str) -> Path:
    """Save what the browser shows as ``build/screenshots/<name>.png``; its path."""
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTEFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def until(driver: Any, condition: Callable[[Any], T], *, timeout: float = 10.0, what: str = "the page") -> T:
    """Wait until ``condition(driver)`` is truthy (polled by Selenium), failing the test at the deadline."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    # A page that re-renders replaces the elements a condition was reading: asked again at the next poll.
    ignored = (NoSuchElementException, StaleElementReferenceException)
    try:
        result: T = WebDriverWait(driver, timeout, poll_frequency=0.05, ignored_exceptions=ignored).until(condition)
    except TimeoutException:
        pytest.fail(
            f"timed out after {timeout}s waiting for {what}; the page says: {driver.find_element('tag name', 'body').text!r}"
        )
    return result


def content_digest(driver: Any, *sources: bytes) -> str:
    """What a picture of the page shows, numbers aside: ``sources`` (the page's own files), its text with each
    number as ``#``, and the window's size."""
    text = re.sub(r"\d+(\.\d+)?", "#", driver.find_element("tag name", "body").text)
    size = driver.get_window_size()
    return hashlib.sha256(b"".join(sources) + text.encode() + f"{size['width']}x{size['height']}".encode()).hexdigest()


def png_text(png: bytes, keyword: bytes) -> bytes | None:
    """The value of a PNG ``tEXt`` chunk named ``keyword``, or ``None``."""
    at = 8  # after the signature
    while at + 8 <= len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        kind, data = png[at + 4 : at + 8], png[at + 8 : at + 8 + length]
        if kind == b"tEXt" and data.partition(b"\0")[0] == keyword:
            return data.partition(b"\0")[2]
        at += 12 + length
    return None


def with_png_text(png: bytes, keyword: bytes, value: bytes) -> bytes:
    """``png`` with a ``tEXt`` chunk ``keyword`` = ``value`` right after its header (IHDR)."""
    data = keyword + b"\0" + value
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    end_of_header = 8 + 12 + 13  # the signature, then IHDR: length, type, 13 bytes, CRC
    return png[:end_of_header] + chunk + png[end_of_header:]


#: Set by ``make screenshots``: the tests then copy their screenshots to the pictures the docs show. ``make test``
#: never writes a tracked file: a picture that no longer shows the page is only warned of.
PUBLISH_VARIABLE = "DRAMATIQ_LEASES_SCREENSHOTS"


def publish(shot: Path, picture: Path, digest: str) -> None:
    """Copy the screenshot ``shot`` to ``picture`` (a picture the docs show) under ``make screenshots``, unless the
    one there shows the same content (its digest); otherwise warn when it no longer does."""
    if picture.exists() and png_text(picture.read_bytes(), DIGEST_KEYWORD) == digest.encode():
        return
    if os.environ.get(PUBLISH_VARIABLE) != "1":
        warnings.warn(f"{picture} no longer shows the page: run `make screenshots`", stacklevel=2)
        return
    picture.parent.mkdir(parents=True, exist_ok=True)
    picture.write_bytes(with_png_text(shot.read_bytes(), DIGEST_KEYWORD, digest.encode()))
