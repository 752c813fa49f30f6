"""The widgets in a real JupyterLab, driven by headless Chromium (Debian's, through Python playwright): live
streaming, Stop, the inspector and the job table, the static record they leave in a saved notebook, a kernel
interrupt, and both themes (screenshots for the README, and a contrast check of text on its background).

Needs `apt-get install -y chromium` (the Makefile's browser-deps target); skipped with the reason when the
browser is missing, except under EXLNB_REQUIRE_BROWSER=1 (.ci/run), where a missing browser fails. Screenshots go
to test-artifacts/ (the README's come from here).
"""

from __future__ import annotations

import ast
import html
import itertools
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from exlnb import EosReason
from exlnb.models import bundled_gguf

nbformat = pytest.importorskip(
    "nbformat", reason="the notebook tests need the notebook stack: pip install -e '.[test]'"
)

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the browser tests need playwright: pip install playwright"
)
TimeoutError, expect = sync_api.TimeoutError, sync_api.expect

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = Path(os.environ.get("EXLNB_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WORKTREE = Path(__file__).resolve().parent.parent
ARTIFACTS = WORKTREE / "test-artifacts"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
RECORDED = (2, 4, 5, 6, 8, 10, 11)  # the cells whose widgets leave a record: answers, samples, inspector, job table
KILLED = (12, 13, 14)  # the cells whose views were live when the kernel died: the front end leaves their record
WAITED, BRANCHED_CELL, REFUSED, CUT, BENCH, KILL = range(15, 21)  # the cells after them; the last kills the kernel
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
# text that must read on its background: WCAG's 4.5:1 for normal text (the branch tree's, live and reopened)
BRANCH_TREE = (".exlnb-branches th", ".exlnb-branches td", ".exlnb-branches code")
READABLE = (
    ".exlnb-token:not(.exlnb-special)",
    ".exlnb-special",
    ".exlnb-status",
    ".exlnb-head",
    ".exlnb-text",
    ".exlnb-warning",
    ".exlnb-summary",
    ".exlnb-jobs td",
    ".exlnb-label",
    ".exlnb-muted",
    ".exlnb-chip",
    ".exlnb-popover",
    ".exlnb-alt-off",
    ".exlnb-branch-refused",
    ".exlnb-kept",
    ".exlnb-forced",
    ".exlnb-bench-table td",
    ".exlnb-legend",
    *BRANCH_TREE,
)
# WCAG 2 contrast of each selector's text against the colour behind it (its own and its ancestors' backgrounds
# composed over white), the lowest over the page
CONTRAST_JS = """selectors => {
  const parse = (c) => {
    const v = c.match(/[\\d.]+/g).map(Number);
    return [v[0], v[1], v[2], v.length > 3 ? v[3] : 1];
  };
  const over = ([r, g, b, a], [R, G, B]) => [r * a + R * (1 - a), g * a + G * (1 - a), b * a + B * (1 - a)];
  const behind = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c[3] > 0) layers.push(c);
      if (c[3] >= 1) break;
    }
    return layers.reverse().reduce((under, layer) => over(layer, under), [255, 255, 255]);
  };
  const lum = (rgb) => {
    const [r, g, b] = rgb.map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const ratio = (a, b) => {
    const [hi, lo] = [lum(a), lum(b)].sort((x, y) => y - x);
    return (hi + 0.05) / (lo + 0.05);
  };
  const result = {};
  for (const selector of selectors) {
    let worst = Infinity;
    for (const el of document.querySelectorAll(selector)) {
      const back = behind(el);
      worst = Math.min(worst, ratio(over(parse(getComputedStyle(el).color), back), back));
    }
    result[selector] = worst === Infinity ? null : worst;
  }
  return result;
}"""
# Notes longer than a 256-token page, so the four samples of the background cell share the prompt's full
# pages (published when the first cell's job finished its prefill) and the inspector has shared pages to show.
NOTES = " ".join(f"Chapter {i}: the dragon bakes loaf number {i} and learns something new." for i in range(1, 31))
STORY = "{notes}\n\nTell me a very long story about a dragon who learns to bake bread, with many chapters."
# a prompt longer than two pages that nothing before has cached: two samples of it share its pages, which the first
# computes while the second waits
LOG = " ".join(f"Entry {i}: the lighthouse keeper logs ship number {i * 7} at dusk." for i in range(1, 41))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on localhost with a token, serving a notebook that loads exlnb on the CPU engine."""
    cells = [
        f"%load_ext exlnb\nimport exlnb\nprint(exlnb.__file__)\nnotes = {NOTES!r}",
        "%exl_load --engine cpu",
        f"%%exl_generate --max-new-tokens 400 --temperature 0.8 --seed 3 --out story\n{STORY}",
        "from exlnb import get_session\nprint('jobs left:', len(get_session().jobs()), story.eos_reason.value)",
        f"%%exl_generate --background --n 4 --max-new-tokens 400 --seed 5\n{STORY}",
        "%exl_cache",
        "%exl_jobs",
        "%exl_cancel --all",
        "%%exl_generate --show-prompt --template llama3 --max-new-tokens 12 --temperature 0\n"
        "What is the capital of France?",
        f"%%exl_generate --max-new-tokens 2000 --out cut\n{STORY}",
        "%%exl_generate --show-prompt --max-new-tokens 12 --temperature 0\nWhat is the capital of France?",
        "%%exl_generate --tokens 5 --max-new-tokens 40 --temperature 0.8 --seed 2 --out dragon\n"
        "Describe a dragon in two sentences.",
        f"%%exl_generate --background --max-new-tokens 2000 --min-new-tokens 2000\n{STORY}",
        "%exl_jobs",
        "%exl_cache",
        f"%%exl_generate --n 2 --max-new-tokens 6 --temperature 0\n{LOG}",
        "%exl_branch dragon --at 3 --out b3",
        # what a token view shows on an engine that cannot branch (a chat server): drawn here on the CPU engine's
        # records, as figures.sample_html draws it there
        "from IPython.display import HTML\nfrom exlnb.engines.remote.engine import CHAT_CANNOT_BRANCH\n"
        "from exlnb.widgets.record import record_html\nfrom exlnb.widgets.tokens import tokens_html\n"
        "HTML(record_html(tokens_html(dragon.token_records, set(), False, 'probability', refusal=CHAT_CANNOT_BRANCH)))",
        "print('stored:', cut.eos_reason.value, len(cut.token_ids))",
        "%exl_bench --request-rate inf --num-requests 3 --prompt-len 8 --output-len 3 --slo ttft_ms=60000",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)  # the kernel dies without a word, as a crash does",
    ]
    with serving_lab(tmp_path_factory.mktemp("lab"), cells) as served:
        yield served


@contextmanager
def serving_lab(root: Path, cells: list[str]) -> Iterator[tuple]:
    """JupyterLab on localhost with a token, serving face.ipynb of these cells from `root`: its url, `root`, and a
    call of its REST API. Skipped (failed under EXLNB_REQUIRE_BROWSER=1) where the browser is missing."""
    if not CHROMIUM.exists():
        missing = f"no browser at {CHROMIUM}: apt-get install -y chromium (make browser-deps)"
        if os.environ.get("EXLNB_REQUIRE_BROWSER") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, root / "face.ipynb")
    # no "Would you like to get notified about Jupyter news?" toast over the screenshots
    settings = root / ".jupyter" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    port, token = free_port(), secrets.token_hex(16)
    # a new user's first %exl_load prepares the bundled model: from the GGUF this machine keeps, into a home of its own
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(root / ".jupyter"),
        JUPYTERLAB_WORKSPACES_DIR=str(root / ".ws"),
        JUPYTER_RUNTIME_DIR=str(root / ".runtime"),
        EXLNB_HOME=str(root / ".exlnb"),
        EXLNB_BUNDLED_GGUF=str(bundled_gguf()),
    )
    with open(root / "lab.log", "w") as log:  # the server writes to its own copy of the file
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                f"--port={port}",
                "--ip=127.0.0.1",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root}",
                "--LabApp.news_url=None",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly",
                "--LabApp.expose_app_in_browser=True",
                "--allow-root",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
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

    def api(method: str, path: str):
        request = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    try:
        yield f"{base}/lab/tree/face.ipynb?token={token}", root, api
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def page(lab):
    url, _, _ = lab
    with browser_page(url) as page:
        yield page


@contextmanager
def browser_page(url: str) -> Iterator:
    """Headless Chromium on the notebook at `url`, once its kernel is idle."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=120_000)
        try:
            yield page
        finally:
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


def first_line(text: str) -> str:
    return next(line for line in text.splitlines() if len(line) > 20)


def use_theme(page, theme: str) -> None:
    page.evaluate(f"window.jupyterapp.commands.execute('apputils:change-theme', {{theme: {THEMES[theme]!r}}})")
    page.wait_for_function(f"document.body.dataset.jpThemeName === {THEMES[theme]!r}")
    time.sleep(1)  # the theme's stylesheet applies


def unreadable(page, selectors) -> dict[str, float | None]:
    """The selectors whose text does not read on its background (below WCAG's 4.5:1), with their lowest ratio,
    or None where there is no such text to measure."""
    ratios = page.evaluate(CONTRAST_JS, list(selectors))
    return {s: ratios[s] for s in selectors if ratios[s] is None or ratios[s] < 4.5}


def table_rows(table) -> list[list[str]]:
    """The text of each row's cells as the markup holds it (a branch's text starts with its forced token, its
    space included), headings included."""
    return table.evaluate(
        "el => [...el.querySelectorAll('tr')].map((tr) => [...tr.children].map((c) => c.textContent))"
    )


# the branch tree as the live kernel drew it ("rows") and the choices made ("chosen": position, token id, its
# text as the popover shows it), which the reopened notebook and its export must keep
BRANCHED: dict[str, list] = {}
GONE: dict[str, str] = {}  # the answer that was streaming when the kernel died, as it stood


def test_stream_widget_grows_stop_ends_the_job_and_leaves_a_record(page):
    ARTIFACTS.mkdir(exist_ok=True)
    run_cell(page, 0)
    assert f"{WORKTREE}/exlnb/__init__.py" in wait_done(page, 0)  # the kernel imports this checkout's exlnb
    run_cell(page, 1)
    loaded = wait_done(page, 1, timeout_s=300)
    assert "cpu engine" in loaded and "\nmodel folder: " in loaded
    # the bundled model prepared: exlnb's one line of progress, at its end, on stdout; no library's bar or widget
    load = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-OutputArea")
    assert load.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
    assert load.locator(".jupyter-widgets, .widget-label").count() == 0 and "Error displaying" not in loaded
    preparing = [line for line in loaded.splitlines() if "preparing SmolLM2" in line]
    assert len(preparing) == 1 and "100%" in preparing[0] and "4/4" in preparing[0], loaded
    assert "Converting" not in loaded and "Writing model shards" not in loaded
    load.screenshot(path=str(ARTIFACTS / "first-load-light.png"))
    run_cell(page, 2)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
    # the widgets re-render their HTML: locators (queried afresh each time), never element handles
    text = cell.locator(".exlnb-text")
    expect(text).not_to_be_empty(timeout=120_000)
    lengths = []
    for _ in range(4):
        lengths.append(len(text.inner_text()))
        time.sleep(1.5)
    assert all(b > a for a, b in itertools.pairwise(lengths)), f"text did not grow steadily: {lengths}"
    status = cell.locator(".exlnb-status")
    assert re.search(r"running\s*\d+/400 tokens", status.inner_text())
    assert "tok/s" in status.inner_text()
    cell.locator(".jp-OutputArea").screenshot(path=str(ARTIFACTS / "stream-live-light.png"))

    cell.locator(".exlnb-stop").click()
    expect(status).to_contain_text("ended: cancelled (stop button)", timeout=30_000)
    wait_done(page, 2, timeout_s=30)  # the cell itself ends once its job is cancelled
    expect(cell.locator(".exlnb-record")).to_be_visible(timeout=10_000)  # the widget became static output
    assert cell.locator(".exlnb-stop").count() == 0
    stopped_at = len(text.inner_text())
    time.sleep(1.0)
    assert len(text.inner_text()) == stopped_at, "text kept growing after Stop"

    run_cell(page, 3)
    assert "jobs left: 0 cancelled" in wait_done(page, 3)


def test_samples_inspector_and_job_table_show_running_jobs_then_settle(page):
    run_cell(page, 4)
    wait_done(page, 4)
    samples = page.locator(".jp-Notebook .jp-Cell").nth(4)
    run_cell(page, 5)
    # the views redraw their HTML: wait on the output area, which stays, never on an element inside it
    inspector = page.locator(".jp-Notebook .jp-Cell").nth(5).locator(".jp-OutputArea")
    inspector.locator(".exlnb-cache").wait_for()
    page.wait_for_function(  # prefix pages shared by the samples, and each sample's own pages
        "el => el.querySelectorAll('.exlnb-grid .exlnb-page.exlnb-shared').length > 0"
        " && el.querySelectorAll('.exlnb-grid .exlnb-page.exlnb-used').length >= 4",
        arg=inspector.element_handle(),
        timeout=60_000,
    )
    assert "pages in use" in inspector.locator(".exlnb-summary").inner_text()
    assert inspector.locator(".exlnb-liveness").inner_text().startswith("live")
    run_cell(page, 6)
    table = page.locator(".jp-Notebook .jp-Cell").nth(6).locator(".jp-OutputArea")
    expect(table.locator("tbody tr")).to_have_count(4)
    # the samples' widget streams them: no job is flagged as one that nobody reads, and the table says what that is
    assert "4 jobs, each read by its stream" in table.locator(".exlnb-summary").inner_text()
    assert "nobody reading" not in inspector.locator(".exlnb-legend").inner_text()
    assert "a job nobody reads still holds its pages" in table.locator(".exlnb-jobs > .exlnb-legend").inner_text()
    assert "field report 1" in table.locator("th", has_text="stream read").get_attribute("title")
    time.sleep(2)  # let the pages fill a little for the picture
    samples.locator(".jp-OutputArea").screenshot(path=str(ARTIFACTS / "stream-n4-live-light.png"))
    head = samples.locator(".exlnb-head").inner_text()
    # one decode rate, named: the samples' tokens over the time while any of them was decoding
    assert "TTFT" in head and re.search(
        r"decode [\d.]+ tok/s \(4 samples together: \d+ tokens over the [\d.]+ s "
        r"while any was decoding\)",
        head,
    ), head
    assert samples.locator(".exlnb-head").count() == 1

    table.locator(".exlnb-cancel").first.click()
    expect(table.locator("tbody tr")).to_have_count(3, timeout=30_000)
    table.locator(".exlnb-cancel-all").click()
    expect(samples.locator(".exlnb-record .exlnb-stopped")).to_have_count(4, timeout=30_000)
    # with no job left, the inspector and the table settle into their last state with jobs
    for index in (5, 6):
        record = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".exlnb-record")
        expect(record).to_contain_text("had ended by", timeout=30_000)
    assert "pages in use" in page.locator(".jp-Notebook .jp-Cell").nth(5).locator(".exlnb-record").inner_text()
    # each job as it ended, not as the table last saw it running (its last state with jobs: the four, or the three
    # left after the first Cancel, as its last drawing before Cancel all had them)
    settled = page.locator(".jp-Notebook .jp-Cell").nth(6).locator(".exlnb-record tbody tr").all()
    assert len(settled) in (3, 4) and {row.locator("td").nth(1).inner_text() for row in settled} == {"ended: cancelled"}
    assert {row.locator("td").nth(5).inner_text() for row in settled} == {"freed"}
    run_cell(page, 7)
    assert "cancelled 0 jobs" in wait_done(page, 7)


def test_a_wrong_template_is_a_warning_above_the_answer(page):
    run_cell(page, 8)
    wait_done(page, 8)
    output = page.locator(".jp-Notebook .jp-Cell").nth(8).locator(".jp-OutputArea")
    expect(output.locator(".exlnb-record")).to_be_visible(timeout=30_000)
    assert output.locator(".exlnb-warning").count() == 1
    assert "does not follow the template" in output.locator(".exlnb-warning").inner_text()
    # llama3's tags, each plain text here, are one finding that names the model's own template
    [finding] = output.locator(".exlnb-warning li").all_inner_texts()
    assert re.fullmatch(
        r"\d+ llama3 tags are plain text here \(<\|begin_of_text\|>, .*\): this model's template is "
        r"chatml \(--template chatml, or auto\)",
        finding,
    ), finding
    assert output.locator(".exlnb-special").count() == 0  # llama3's tags are ordinary text to this model
    assert output.locator(".exlnb-token").count() > 20


def test_show_prompt_marks_the_special_tokens_of_the_model_template(page):
    run_cell(page, 10)
    wait_done(page, 10)
    output = page.locator(".jp-Notebook .jp-Cell").nth(10).locator(".jp-OutputArea")
    expect(output.locator(".exlnb-record")).to_be_visible(timeout=30_000)
    assert output.locator(".exlnb-special").count() >= 4 and output.locator(".exlnb-warning").count() == 0


def test_an_interrupt_prints_one_line_and_no_traceback(page):
    run_cell(page, 9)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(9)
    expect(cell.locator(".exlnb-text")).not_to_be_empty(timeout=120_000)
    page.evaluate("window.jupyterapp.commands.execute('kernelmenu:interrupt')")
    output = wait_done(page, 9, timeout_s=30)
    error = cell.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").inner_text()
    assert re.fullmatch(r"interrupted: job \d+ cancelled after \d+ tokens", error.strip()), error
    assert "Traceback" not in output and "CancelledError" not in output
    run_cell(page, CUT)  # --out stored the interrupted answer, as Stop stores it
    tokens = int(error.split("after ")[1].split()[0])
    assert wait_done(page, CUT).strip() == f"stored: cancelled {tokens}"


def test_the_token_view_opens_a_popover_of_both_probabilities_by_keyboard_and_its_text_copies(page):
    run_cell(page, 11)
    wait_done(page, 11)
    output = page.locator(".jp-Notebook .jp-Cell").nth(11).locator(".jp-OutputArea")
    expect(output.locator(".exlnb-record")).to_be_visible(timeout=30_000)
    chips = output.locator(".exlnb-token-view > .exlnb-chip")
    assert chips.count() >= 5 and chips.first.get_attribute("title") is None
    popover = chips.first.locator(".exlnb-popover")
    expect(popover).to_be_hidden()
    chips.first.focus()
    expect(popover).to_be_visible()
    box = output.bounding_box()  # the popover shows over what follows the output: a picture of both
    page.screenshot(path=str(ARTIFACTS / "token-popover-light.png"), clip={**box, "height": box["height"] + 160})
    text = popover.inner_text()
    assert "model's probability" in text and "sampled with" in text and "before sampling" in text
    assert popover.locator("tr").count() == 5  # --tokens 5: five alternatives, whatever top-k kept
    copied = page.evaluate(
        "el => { window.getSelection().selectAllChildren(el); return window.getSelection().toString(); }",
        popover.element_handle(),
    )
    assert "model's probability" in copied
    page.keyboard.press("Tab")  # the next token is the next tab stop, with its own popover
    expect(chips.nth(1).locator(".exlnb-popover")).to_be_visible()
    expect(popover).to_be_hidden()
    page.evaluate("document.activeElement.blur()")


def test_choosing_an_alternative_in_the_token_view_starts_a_branch_shown_in_the_tree_under_it(page):
    output = page.locator(".jp-Notebook .jp-Cell").nth(11).locator(".jp-OutputArea")
    chips = output.locator(".exlnb-token-view > .exlnb-chip")
    chosen = []
    for at, by_keyboard in [(2, False), (4, True)]:  # a click on one token's alternative, Enter on another's
        chip = chips.nth(at)
        if by_keyboard:
            chip.focus()
            page.keyboard.press("ArrowDown")  # into the token's alternatives, not to the next cell
        else:
            chip.hover()
        popover = chip.locator(".exlnb-popover")
        expect(popover.locator(".exlnb-branch-on")).to_be_visible()  # the kernel runs: choosing branches
        expect(popover.locator(".exlnb-branch-off")).to_be_hidden()
        choice = popover.locator(".exlnb-alt").first
        chosen.append((str(at), choice.get_attribute("data-token"), choice.inner_text()))
        if by_keyboard:
            expect(choice).to_be_focused()
            page.keyboard.press("Enter")
        else:
            choice.click()
    page.evaluate("document.activeElement.blur()")

    tree = output.locator(".exlnb-branches")
    expect(tree.locator("tr")).to_have_count(4, timeout=30_000)  # headings, the answer, two branches
    ends = tree.locator("td.exlnb-muted")  # each answer's end, "running" while it runs
    expect(ends.filter(has_text=re.compile(r"^running$"))).to_have_count(0, timeout=60_000)
    rows = table_rows(tree)
    assert rows[0] == ["branch", "of", "at", "forced token", "text", "ended"]
    branches = sorted(rows[2:], key=lambda row: int(row[2]))
    for (_number, parent, at, forced, _text, ended), (chosen_at, token, words) in zip(branches, chosen):
        assert parent == "#0" and at == chosen_at and forced.startswith(f"{words} ({token})in place of "), rows
        assert ended in {reason.words for reason in EosReason}
    # each branch's text after the end of what it kept of the answer, its forced token marked
    marked = tree.locator("tr").evaluate_all(
        "trs => trs.slice(2).map((tr) => [tr.children[2].textContent, "
        "tr.querySelector('span.exlnb-forced').textContent])"
    )
    assert sorted(marked, key=lambda m: int(m[0])) == [[at, ast.literal_eval(words)] for at, _token, words in chosen]
    assert {row[0] for row in rows[1:]} == {"#0", "#1", "#2"}
    BRANCHED.update(rows=rows, chosen=chosen)


def test_a_sample_that_waited_for_another_samples_prefill_says_so(page):
    run_cell(page, WAITED)
    wait_done(page, WAITED)
    output = page.locator(".jp-Notebook .jp-Cell").nth(WAITED).locator(".jp-OutputArea")
    expect(output.locator(".exlnb-record")).to_be_visible(timeout=30_000)
    first, second = output.locator(".exlnb-status").all_inner_texts()
    assert "TTFT" not in output.locator(".exlnb-head").inner_text()  # each sample's own, under it
    assert re.search(r"prefill \d+ tokens in \d+ ms", first) and "waited" not in first
    assert re.search(r"waited for sample 0's prefill of \d+ prompt tokens\s*prefill \d+ tokens(?! in)", second), second


def test_a_branch_streams_its_forced_token_and_its_tree_shows_what_it_kept(page):
    run_cell(page, BRANCHED_CELL)
    wait_done(page, BRANCHED_CELL)
    output = page.locator(".jp-Notebook .jp-Cell").nth(BRANCHED_CELL).locator(".jp-OutputArea")
    expect(output.locator(".exlnb-record")).to_have_count(2, timeout=30_000)  # the branch's view, then its tree
    chips = output.locator(".exlnb-token-view > .exlnb-chip")
    forced = chips.first
    assert (
        "exlnb-forced" in forced.get_attribute("class")
        and output.locator(".exlnb-token-view .exlnb-forced").count() == 1
    )
    forced.focus()
    popover = forced.locator(".exlnb-popover")
    expect(popover).to_be_visible()
    assert "forced here by the branch" in popover.inner_text() and "← forced" in popover.inner_text()
    page.evaluate("document.activeElement.blur()")
    shown = "".join(chips.evaluate_all("cs => cs.map((c) => c.firstChild.textContent)"))
    row = output.locator(".exlnb-branches tr").last  # b3, the newest branch of dragon's tree
    kept, chosen = row.locator(".exlnb-kept").inner_text(), row.locator("span.exlnb-forced").inner_text()
    assert kept and chosen and shown.startswith(chosen)  # the view starts with the forced token, as the text does
    assert row.locator("td").nth(3).inner_text().startswith(f"{chosen!r} (") and "in place of" in row.inner_text()


def test_where_branching_cannot_work_the_alternatives_are_greyed_out_and_say_why(page):
    run_cell(page, REFUSED)
    wait_done(page, REFUSED)
    output = page.locator(".jp-Notebook .jp-Cell").nth(REFUSED).locator(".jp-OutputArea")
    chip = output.locator(".exlnb-token-view > .exlnb-chip").nth(2)
    chip.hover()
    popover = chip.locator(".exlnb-popover")
    expect(popover).to_be_visible()
    assert popover.locator(".exlnb-alt").count() == 0 and popover.locator(".exlnb-alt-off").count() >= 1
    expect(popover.locator(".exlnb-branch-refused")).to_contain_text("branching on a server needs --api completions")
    assert popover.locator(".exlnb-alt-off").first.evaluate("el => getComputedStyle(el).cursor") == "not-allowed"
    box = output.bounding_box()
    page.screenshot(path=str(ARTIFACTS / "branch-refused-light.png"), clip={**box, "height": box["height"] + 200})
    page.mouse.move(0, 0)


def test_the_bench_table_keeps_each_rate_on_one_line(page):
    run_cell(page, BENCH)
    wait_done(page, BENCH, timeout_s=180)
    table = page.locator(".jp-Notebook .jp-Cell").nth(BENCH).locator(".exlnb-bench-table")
    expect(table).to_be_visible(timeout=30_000)
    assert "SLO" in table.inner_text()
    lines = table.evaluate("""t => [...t.querySelectorAll('td')].map((cell) => {
        const range = document.createRange(); range.selectNodeContents(cell);
        return new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size; })""")
    assert set(lines) == {1}, lines  # no value wraps onto a second line
    output = page.locator(".jp-Notebook .jp-Cell").nth(BENCH).locator(".jp-OutputArea-output")
    assert table.bounding_box()["width"] <= output.bounding_box()["width"]  # and the table fits: headings wrap


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_records_read_well_in_light_and_dark_themes(page, theme):
    use_theme(page, theme)
    for index, name in [
        (2, "stream"),
        (4, "stream-n4"),
        (5, "cache-inspector"),
        (6, "job-table"),
        (8, "wrong-template"),
        (10, "show-prompt"),
        (11, "token-view"),
        (WAITED, "stream-waited"),
        (BRANCHED_CELL, "branch-view"),
        (REFUSED, "token-view-refused"),
        (BENCH, "bench"),
    ]:
        output = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea")
        output.scroll_into_view_if_needed()
        output.screenshot(path=str(ARTIFACTS / f"{name}-{theme}.png"))
    assert not unreadable(page, READABLE)


def test_every_live_view_says_at_once_that_the_kernel_has_gone(page):
    cells = page.locator(".jp-Notebook .jp-Cell")
    run_cell(page, 12)
    wait_done(page, 12)
    expect(cells.nth(12).locator(".exlnb-text")).not_to_be_empty(timeout=120_000)
    for index in (13, 14):
        run_cell(page, index)
        wait_done(page, index)
    expect(cells.nth(13).locator("tbody tr")).to_have_count(1, timeout=30_000)
    views = [cells.nth(i).locator(".jp-OutputArea .exlnb").first for i in (12, 13, 14)]
    for view in views:
        expect(view.locator(".exlnb-gone-note")).to_be_hidden()
    token_view = cells.nth(11).locator(".exlnb-token-view")
    token_view.locator(".exlnb-chip").nth(2).focus()  # the answer's kernel runs: its alternatives branch
    expect(token_view).to_have_class(re.compile("exlnb-branching"))
    page.evaluate("document.activeElement.blur()")

    answer = cells.nth(12).locator(".exlnb-text").inner_text()
    run_cell(page, KILL)
    for view in views:  # no click needed: each view hears the kernel go
        expect(view.locator(".exlnb-gone-note")).to_be_visible(timeout=30_000)
        expect(view.locator("button:visible")).to_have_count(0)
        assert view.locator("button:enabled").count() == 0
    for index in KILLED:  # and writes its last state into its output, as the kernel's record would have
        expect(cells.nth(index).locator(".exlnb-record.exlnb-gone")).to_have_count(1, timeout=30_000)
    GONE["answer"] = cells.nth(12).locator(".exlnb-record .exlnb-text").inner_text()
    assert GONE["answer"].startswith(answer)
    for index, name in zip(KILLED, ("stream", "jobs", "cache")):
        cells.nth(index).locator(".jp-OutputArea").screenshot(path=str(ARTIFACTS / f"gone-{name}-dark.png"))
    after = views[0].locator(".exlnb-state").evaluate("el => getComputedStyle(el, '::after').content")
    assert "when the kernel went" in after  # "running when the kernel went", not "running"
    expect(views[2].locator(".exlnb-liveness")).to_be_hidden()
    # the token view's alternatives branch no more, and its popovers say so (a dialog covers the page by now)
    expect(token_view).not_to_have_class(re.compile("exlnb-branching"), timeout=30_000)
    hints = [token_view.locator(f".exlnb-branch-{state}").first for state in ("off", "on")]
    assert [hint.evaluate("el => getComputedStyle(el).display") for hint in hints] == ["inline", "none"]
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=120_000)


def test_a_saved_notebook_keeps_answers_and_statistics_after_the_kernel_has_gone(page, lab):
    _, root, api = lab
    answer = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".exlnb-text").inner_text()
    page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("!document.querySelector('.jp-mod-dirty')")
    for session in api("GET", "/api/sessions"):
        api("DELETE", f"/api/kernels/{session['kernel']['id']}")  # shut the kernel down

    saved = nbformat.read(root / "face.ipynb", as_version=4)
    recorded = [saved.cells[i] for i in (1, *RECORDED, *KILLED)]  # %exl_load's progress is text too, no widget
    assert not [o for c in recorded for o in c.outputs if WIDGET_MIME in o.get("data", {})]
    assert not [o for o in saved.cells[1].outputs if o.get("name") == "stderr"]  # nothing on red
    for index in KILLED:  # the front end's records of the views the kernel never settled
        [gone] = [o for o in saved.cells[index].outputs if "exlnb-gone" in o.get("data", {}).get("text/html", "")]
        assert gone["data"]["text/plain"].startswith("The kernel that drew this has gone")
    stopped = saved.cells[2].outputs[-1]["data"]["text/plain"]  # the plain record of a run the Stop button ended
    assert "[stopped · " in stopped and "[done" not in stopped
    [tree_text] = [o["data"]["text/plain"] for o in saved.cells[11].outputs if "← #0 at " in o["data"]["text/plain"]]
    assert all(f"← #0 at {at}, forced {words} ({token})" in tree_text for at, token, words in BRANCHED["chosen"])

    page.reload()
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    cells = page.locator(".jp-Notebook .jp-Cell")
    for index, texts in [
        (2, [first_line(answer), "TTFT", "ended: cancelled (stop button)"]),
        (5, ["pages in use"]),
        (6, ["job", "new / max"]),
    ]:
        cells.nth(index).scroll_into_view_if_needed()  # JupyterLab renders the cells in view
        for text in texts:
            expect(cells.nth(index).locator(".exlnb-record")).to_contain_text(text, timeout=60_000)
    for index in (*RECORDED, *KILLED):
        cells.nth(index).scroll_into_view_if_needed()
        records = cells.nth(index).locator(".exlnb-record")
        expect(records).to_have_count(2 if index == 11 else 1)  # the token view's cell: its branch tree's too
        for record in records.all():
            expect(record).to_be_visible()
        assert "model not found" not in cells.nth(index).inner_text()
    for index in KILLED:  # the views the kernel's death cut short, as they last were, saying so
        expect(cells.nth(index).locator(".exlnb-record .exlnb-gone-note")).to_be_visible()
    assert first_line(GONE["answer"]) in cells.nth(12).locator(".exlnb-record .exlnb-text").inner_text()
    assert "job" in cells.nth(13).locator(".exlnb-record tbody").inner_text()
    assert "pages in use" in cells.nth(14).locator(".exlnb-record").inner_text()
    cells.nth(1).scroll_into_view_if_needed()
    assert "Error displaying widget" not in cells.nth(1).inner_text()  # %exl_load left text only
    chip = cells.nth(11).locator(".exlnb-token-view > .exlnb-chip").first
    chip.focus()  # the reopened record's token popover still opens from the keyboard, no kernel needed
    expect(chip.locator(".exlnb-popover")).to_be_visible()
    assert "model's probability" in chip.locator(".exlnb-popover").inner_text()
    expect(chip.locator(".exlnb-branch-off")).to_be_visible()  # a record: branching needs the live kernel
    expect(chip.locator(".exlnb-branch-on")).to_be_hidden()
    tree = cells.nth(11).locator(".exlnb-branches")
    expect(tree.locator("tr")).to_have_count(len(BRANCHED["rows"]))
    assert table_rows(tree) == BRANCHED["rows"]  # parents, positions, forced tokens, texts and ends, as drawn live

    subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", str(root / "face.ipynb")],
        check=True,
        capture_output=True,
    )
    exported = (root / "face.html").read_text()
    assert html.escape(first_line(answer)) in exported and "VBox(" not in exported
    # the export as a reader sees it: nbconvert writes the forced tokens' quotes as it likes
    shown = html.unescape(re.sub(r"<[^>]+>", "", exported))
    assert all(f"{words} ({token})" in shown for _at, token, words in BRANCHED["chosen"])
    assert all(row[4] in shown for row in BRANCHED["rows"][1:])  # each answer's text, the branches' too


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_reopened_branch_tree_reads_well_in_light_and_dark_themes(page, theme):
    page.evaluate("document.activeElement.blur()")  # no token's popover over the tree
    use_theme(page, theme)
    tree = page.locator(".jp-Notebook .jp-Cell").nth(11).locator(".exlnb-branches")
    tree.scroll_into_view_if_needed()
    tree.screenshot(path=str(ARTIFACTS / f"branch-tree-record-{theme}.png"))
    assert table_rows(tree) == BRANCHED["rows"]
    assert not unreadable(page, BRANCH_TREE)
    for index, name in zip(KILLED, ("stream", "jobs", "cache")):  # what the front end kept of the killed kernel's views
        output = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea")
        output.scroll_into_view_if_needed()
        output.screenshot(path=str(ARTIFACTS / f"gone-{name}-reopened-{theme}.png"))
    assert not unreadable(page, (".exlnb-gone-note", ".exlnb-text", ".exlnb-summary", ".exlnb-jobs td"))
