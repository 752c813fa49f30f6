"""The widgets in a real JupyterLab, driven by headless Chromium (Debian's, through Python playwright).

Needs `apt-get install -y chromium` (the Makefile's browser-deps target); skipped with the reason when the
browser is missing, except under EXLNB_REQUIRE_BROWSER=1 (.ci/run), where a missing browser fails. Screenshots go to test-artifacts/ (the README's come from here).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright: pip install playwright")
TimeoutError, expect = sync_api.TimeoutError, sync_api.expect

pytestmark = pytest.mark.browser

CHROMIUM = Path(os.environ.get("EXLNB_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# Notes longer than a 256-token page, so the four samples of the background cell share the prompt's full
# pages (published when the first cell's job finished its prefill) and the inspector has shared pages to show.
NOTES = " ".join(f"Chapter {i}: the dragon bakes loaf number {i} and learns something new." for i in range(1, 31))
STORY = "{notes}\n\nTell me a very long story about a dragon who learns to bake bread, with many chapters."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on localhost with a token, serving a notebook that loads exlnb on the CPU engine."""
    if not CHROMIUM.exists():
        missing = f"no browser at {CHROMIUM}: apt-get install -y chromium (make browser-deps)"
        if os.environ.get("EXLNB_REQUIRE_BROWSER") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("lab")
    cells = [
        f"%load_ext exlnb\nnotes = {NOTES!r}",
        "%exl_load --engine cpu",
        f"%%exl_generate --max-new-tokens 400 --temperature 0.8 --seed 3 --out story\n{STORY}",
        "from exlnb import get_session\nprint('jobs left:', len(get_session().jobs()), story.eos_reason.value)",
        f"%%exl_generate --background --n 4 --max-new-tokens 400 --seed 5\n{STORY}",
        "%exl_cache",
        "%exl_jobs",
        "%exl_cancel --all",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, root / "face.ipynb")
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(root / ".jupyter"), JUPYTERLAB_WORKSPACES_DIR=str(root / ".ws"),
               JUPYTER_RUNTIME_DIR=str(root / ".runtime"))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly",
         "--allow-root"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(root / "lab.log", "w"),
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {(root / 'lab.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield f"{base}/lab/tree/face.ipynb?token={token}", root
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def page(lab):
    from playwright.sync_api import sync_playwright

    url, _ = lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=120_000)
        yield page
        browser.close()


def run_cell(page, index: int) -> None:
    """Run cell `index` with Shift+Enter in its editor; wait until the kernel has taken it ([*] or a count)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    prompt = cell.locator(".jp-InputArea-prompt")
    for _ in range(3):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                "el => /\\[(\\*|\\d+)\\]/.test(el.innerText)", arg=prompt.element_handle(), timeout=10_000
            )
            return
        except TimeoutError:
            continue
    raise AssertionError(f"cell {index} never started running")


def wait_done(page, index: int, timeout_s: float = 120) -> str:
    """Wait until cell `index` shows an execution count, return its output text."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        prompt = cell.locator(".jp-InputArea-prompt").inner_text()
        if any(ch.isdigit() for ch in prompt):
            return cell.locator(".jp-OutputArea").inner_text()
        time.sleep(0.25)
    raise AssertionError(f"cell {index} did not finish in {timeout_s} s: prompt {prompt!r}")


def test_stream_widget_grows_and_stop_ends_the_job(page):
    ARTIFACTS.mkdir(exist_ok=True)
    run_cell(page, 0)
    wait_done(page, 0)
    run_cell(page, 1)
    assert "cpu engine" in wait_done(page, 1, timeout_s=300)
    run_cell(page, 2)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
    # the widgets re-render their HTML: locators (queried afresh each time), never element handles
    text = cell.locator(".exlnb-text")
    expect(text).not_to_be_empty(timeout=120_000)
    lengths = []
    for _ in range(4):
        lengths.append(len(text.inner_text()))
        time.sleep(1.5)
    assert all(b > a for a, b in zip(lengths, lengths[1:])), f"text did not grow steadily: {lengths}"
    status = cell.locator(".exlnb-status")
    assert "decode" in status.inner_text()
    cell.screenshot(path=str(ARTIFACTS / "stream-widget.png"))

    cell.locator(".exlnb-stop").click()
    expect(status).to_contain_text("eos: cancelled (stop button)", timeout=30_000)
    wait_done(page, 2, timeout_s=30)  # the cell itself ends once its job is cancelled
    stopped_at = len(text.inner_text())
    time.sleep(1.0)
    assert len(text.inner_text()) == stopped_at, "text kept growing after Stop"

    run_cell(page, 3)
    assert "jobs left: 0 cancelled" in wait_done(page, 3)


def test_cache_inspector_and_job_table_show_running_jobs(page):
    run_cell(page, 4)
    wait_done(page, 4)
    run_cell(page, 5)
    inspector = page.locator(".jp-Notebook .jp-Cell").nth(5).locator(".exlnb-cache")
    inspector.wait_for()
    page.wait_for_function(  # prefix pages shared by the samples, and each sample's own pages
        "el => el.querySelectorAll('.exlnb-page.exlnb-shared').length > 0"
        " && el.querySelectorAll('.exlnb-page.exlnb-used').length >= 4",
        arg=inspector.element_handle(), timeout=60_000,
    )
    summary = inspector.locator(".exlnb-summary").inner_text()
    assert "pages in use" in summary and "live" in summary
    run_cell(page, 6)
    table = page.locator(".jp-Notebook .jp-Cell").nth(6).locator(".exlnb-jobs")
    table.wait_for()
    page.wait_for_function("el => el.querySelectorAll('tbody tr').length === 4", arg=table.element_handle())
    time.sleep(2)  # let the pages fill a little for the picture
    inspector.screenshot(path=str(ARTIFACTS / "cache-inspector.png"))
    table.screenshot(path=str(ARTIFACTS / "job-table.png"))

    table.locator(".exlnb-cancel").first.click()
    page.wait_for_function("el => el.querySelectorAll('tbody tr').length === 3", arg=table.element_handle(),
                           timeout=30_000)
    table.locator(".exlnb-cancel-all").click()
    page.wait_for_function("el => el.querySelectorAll('tbody tr').length === 0", arg=table.element_handle(),
                           timeout=30_000)
    expect(inspector.locator(".exlnb-summary")).to_contain_text("idle", timeout=30_000)
    assert "0 of" in inspector.locator(".exlnb-summary").inner_text()
    run_cell(page, 7)
    assert "cancelled 0 jobs" in wait_done(page, 7)
