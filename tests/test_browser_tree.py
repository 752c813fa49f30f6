"""The sample tree in a real JupyterLab, driven by headless Chromium: drawn as it grows, grown by mouse (a token
chosen, Expand) and by keyboard (rows walked with the arrow keys, text forced with f), readable in both themes, a
tree of 256 samples of 256 tokens drawn and walked (timed: test-artifacts/tree-timing.json, docs/tree.md), and the
record a saved notebook keeps once its kernel has gone, reopened and exported.

The browser and JupyterLab are set up as tests/test_browser.py sets them up (`serving_lab`, `browser_page`).
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import pytest

from exlnb.widgets.tree_figure import SHADED
from tests.test_browser import (
    ARTIFACTS,
    WIDGET_MIME,
    browser_page,
    nbformat,
    run_cell,
    serving_lab,
    unreadable,
    use_theme,
    wait_done,
)

sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright")
expect = sync_api.expect

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SAMPLES = TOKENS = 256
# a tree of SAMPLES samples of TOKENS tokens, merged into the growth of a one-token tree so that its view is live:
# at every depth three tokens drawn with 0.75, 0.2 and 0.05, so samples part within a few tokens, as sampling at
# temperature 1 does (about 65,000 nodes, at most 511 rows)
BIG_TREE = f"""\
import random, time
from exlnb import get_session, show_tree
from exlnb.engines.token_info import TokenInfo

session = get_session()
growth = session.grow_tree("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n", n=1, max_new_tokens=1)
growth.wait()
rng = random.Random(0)
depths = [[rng.randrange(session.tokenizer.vocab_size) for _ in range(3)] for _ in range({TOKENS})]
texts = {{t: session.tokenizer.decode([t]) for row in depths for t in row}}
weights = (0.75, 0.2, 0.05)
with growth._lock:
    for sample in range({SAMPLES}):
        growth._builder.enter(0, True)
        at = 0
        for row in depths:
            pick = rng.choices(range(3), weights=weights)[0]
            alternatives = tuple((t, texts[t], w) for t, w in zip(row, weights))
            info = TokenInfo(row[pick], texts[row[pick]], weights[pick], alternatives, weights[pick])
            token, provenance = row[pick], growth.provenance
            at = growth._builder.step(at, token, texts[token], drawn=True, provenance=provenance, info=info)
        growth._builder.end(at, "max new tokens reached")
big = growth.tree()
view = show_tree(growth, display="widget")
print("displayed", round(time.time() * 1000), len(big.nodes), len(big.chains()), len(view.record()["text/html"]))"""
CELLS = [
    "%load_ext exlnb\nimport exlnb\nprint(exlnb.__file__)",
    "%exl_load --engine cpu",
    "%%exl_tree --n 8 --max-new-tokens 10 --temperature 1.0 --seed 1 --out tree\nName a colour.",
    "print('stored', tree.samples, len(tree.nodes), tree.nodes[0].explored)",
    BIG_TREE,
]
TREE_READABLE = (
    ".exlnb-tree .exlnb-head",
    ".exlnb-chain > span",
    ".exlnb-count",
    ".exlnb-figs",
    ".exlnb-tree-status",
    ".exlnb-tree-chosen",
    ".exlnb-tree-off",
)
TIMING = ARTIFACTS / "tree-timing.json"
SEEN: dict[str, object] = {}  # what the live kernel drew, which the reopened record must keep


@pytest.fixture(scope="module")
def tree_lab(tmp_path_factory):
    with serving_lab(tmp_path_factory.mktemp("tree-lab"), CELLS) as served:
        yield served


@pytest.fixture(scope="module")
def page(tree_lab):
    url, _, _ = tree_lab
    with browser_page(url) as page:
        yield page


def output(page, index: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea")


def node_count(page, index: int) -> int:
    return output(page, index).locator(".exlnb-chain > span").count()


def character_point(text_run, index: int, across: float) -> tuple[float, float]:
    """A point on the character at `index` of a run of text, `across` of its width from its left, scrolled to the
    middle of the page first: a long run wraps over more lines than the page shows, so it has no one box to click
    relative to, and in view as a whole it may leave the character under the notebook's tab bar."""
    return text_run.evaluate(
        """(el, [index, across]) => {
            const range = document.createRange();
            range.setStart(el.firstChild, index);
            range.setEnd(el.firstChild, index + 1);
            const scrolls = (box) =>
                box.scrollHeight > box.clientHeight && /auto|scroll/.test(getComputedStyle(box).overflowY);
            let scroller = el.parentElement;
            while (!scrolls(scroller)) scroller = scroller.parentElement;
            scroller.scrollTop += range.getBoundingClientRect().top - innerHeight / 2;
            const box = range.getClientRects()[0];
            return [box.left + across * box.width, box.top + box.height / 2];
        }""",
        [index, across],
    )


def test_the_tree_is_drawn_as_it_grows_and_its_kernel_makes_it_live(page):
    ARTIFACTS.mkdir(exist_ok=True)
    run_cell(page, 0)
    wait_done(page, 0)
    run_cell(page, 1)
    assert "cpu engine" in wait_done(page, 1, timeout_s=300)
    run_cell(page, 2)
    tree = output(page, 2).locator(".exlnb-tree")
    expect(tree.locator("summary[data-node]").first).to_be_visible(timeout=120_000)
    wait_done(page, 2, timeout_s=180)
    expect(tree).to_have_class(re.compile("exlnb-tree-live"), timeout=30_000)  # view.js heard its chooser
    expect(tree.locator(".exlnb-tree-actions")).to_be_visible()
    expect(tree.locator(".exlnb-tree-off")).to_be_hidden()
    assert "8 samples of" in tree.locator(".exlnb-head").inner_text()
    assert tree.locator("[role=tree] [role=treeitem]").count() >= 2
    output(page, 2).screenshot(path=str(ARTIFACTS / "tree-live-light.png"))


def test_a_token_chosen_with_the_mouse_is_expanded_to_the_mass(page):
    tree = output(page, 2).locator(".exlnb-tree")
    before = node_count(page, 2)
    branching = tree.locator("summary[data-node]", has_text="untaken").first  # a row after which samples part
    untaken = float(re.search(r"untaken ([\d.]+)", branching.inner_text())[1])
    node = branching.get_attribute("data-node")
    branching.locator(".exlnb-chain > span").last.click()  # its last token: the node they part after
    expect(tree.locator(".exlnb-tree-chosen")).to_contain_text("(row #")
    tree.locator(".exlnb-tree-mass").fill(f"{min(0.99, 1 - untaken + 0.1):.2f}")  # more than is taken there
    tree.locator("button[data-act=expand]").click()
    expect(tree.locator(".exlnb-chain > .exlnb-given").first).to_be_visible(timeout=120_000)
    page.wait_for_function(
        "([el, n]) => el.querySelectorAll('.exlnb-chain > span').length > n && !/expanding/.test(el.innerText)",
        arg=[output(page, 2).element_handle(), before],
        timeout=120_000,
    )
    assert "+" in tree.locator(".exlnb-head").inner_text()  # expanded samples counted apart from the drawn
    expect(tree.locator(".exlnb-tree-status")).to_contain_text(f"node {node}: ")
    run_cell(page, 3)
    stored = wait_done(page, 3)  # --out holds the tree the view shows
    assert re.search(r"stored 8 \d+ [1-9]", stored), stored


def test_rows_are_walked_and_text_is_forced_by_keyboard(page):
    tree = output(page, 2).locator(".exlnb-tree")
    tree.locator("details.exlnb-tree-item:not(.exlnb-leaf) > summary").first.focus()  # a row samples go on after
    first = page.evaluate("document.activeElement.dataset.node")
    page.keyboard.press("ArrowDown")
    assert page.evaluate("document.activeElement.dataset.node") != first
    page.keyboard.press("ArrowUp")
    assert page.evaluate("document.activeElement.dataset.node") == first
    page.keyboard.press("f")
    expect(tree.locator(".exlnb-tree-text")).to_be_focused()
    page.keyboard.type(" Crimson")
    page.keyboard.press("Enter")
    forced = tree.locator(".exlnb-chain > .exlnb-given", has_text="Cr")
    expect(forced.first).to_be_visible(timeout=120_000)
    page.wait_for_function("el => !/forcing/.test(el.innerText)", arg=output(page, 2).element_handle(), timeout=120_000)
    assert "forced" in forced.first.get_attribute("title")
    with_branches = tree.locator("details.exlnb-tree-item:not(.exlnb-leaf) > summary").first
    with_branches.focus()
    page.keyboard.press("ArrowLeft")  # folds the row
    assert not with_branches.evaluate("el => el.parentElement.open")
    page.keyboard.press("ArrowRight")  # unfolds it
    assert with_branches.evaluate("el => el.parentElement.open")
    page.evaluate("document.activeElement.blur()")
    SEEN["texts"] = [t for t in tree.locator(".exlnb-chain").all_inner_texts() if t.strip()]


def test_a_tree_of_256_samples_of_256_tokens_is_drawn_and_walked(page):
    run_cell(page, 4)
    wait_done(page, 4, timeout_s=600)
    # the cell's count can show before its last output is drawn (the reply and the print travel apart, and the
    # browser is drawing the widget before it): wait for the line itself, which says what it found where it fails
    line = re.compile(r"displayed (\d+) (\d+) (\d+) (\d+)")
    expect(output(page, 4)).to_contain_text(line, timeout=120_000)
    displayed, nodes, rows, size = map(int, line.search(output(page, 4).inner_text()).groups())
    big = output(page, 4).locator(".exlnb-tree")
    page.wait_for_function(
        "([el, n]) => el.querySelectorAll('summary[data-node]').length === n",
        arg=[output(page, 4).element_handle(), rows],
        polling="raf",
        timeout=120_000,
    )
    drawn = page.evaluate("Date.now()")
    expect(big).to_have_class(re.compile("exlnb-tree-live"), timeout=30_000)
    big.locator("summary[data-node]").first.focus()
    keys = page.evaluate(
        """() => [...Array(20)].map(() => {
            const start = performance.now();
            document.activeElement.dispatchEvent(new KeyboardEvent("keydown", {key: "ArrowDown", bubbles: true}));
            document.body.offsetHeight;  // the layout the move forces
            return performance.now() - start;
        })"""
    )
    folds = big.locator("details.exlnb-tree-item").first.evaluate(
        """el => [...Array(10)].map(() => {
            const start = performance.now();
            el.open = !el.open;
            document.body.offsetHeight;
            return performance.now() - start;
        })"""
    )
    moved = page.evaluate("document.activeElement.dataset.node")
    assert moved != big.locator("summary[data-node]").first.get_attribute("data-node")
    page.evaluate("document.activeElement.blur()")
    tail = big.locator(".exlnb-tail").first  # a long row's last tokens, one run of text
    first_length = int(tail.get_attribute("data-lengths").split(",")[0])
    # the right half of the first tail token's last character (a caret lands after it), then the next token's first
    for character, token in ((first_length - 1, SHADED + 1), (first_length, SHADED + 2)):
        page.mouse.click(*character_point(tail, character, 0.75))
        expect(big.locator(".exlnb-tree-chosen")).to_contain_text(f", token {token})")
    timing = {
        "samples": SAMPLES,
        "tokens": TOKENS,
        "nodes": nodes,
        "rows": rows,
        "html_bytes": size,
        "displayed_to_drawn_ms": drawn - displayed,
        "arrow_key_ms_median": sorted(keys)[len(keys) // 2],
        "arrow_key_ms_max": max(keys),
        "fold_ms_median": sorted(folds)[len(folds) // 2],
    }
    TIMING.write_text(json.dumps(timing, indent=2) + "\n")
    print(timing)
    assert nodes > SAMPLES * TOKENS // 2 and rows <= 2 * SAMPLES - 1


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_tree_reads_well_in_light_and_dark_themes(page, theme):
    use_theme(page, theme)
    tree = output(page, 2)
    tree.scroll_into_view_if_needed()
    tree.screenshot(path=str(ARTIFACTS / f"tree-{theme}.png"))
    assert not unreadable(page, TREE_READABLE)


def test_a_saved_tree_is_kept_once_the_kernel_has_gone_and_exported(page, tree_lab):
    _, root, api = tree_lab
    use_theme(page, "light")
    page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("!document.querySelector('.jp-mod-dirty')")
    for session in api("GET", "/api/sessions"):
        api("DELETE", f"/api/kernels/{session['kernel']['id']}")
    saved = nbformat.read(root / "face.ipynb", as_version=4)
    assert not [o for o in saved.cells[2].outputs if WIDGET_MIME in o.get("data", {})]

    page.reload()
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
    cell.scroll_into_view_if_needed()
    tree = cell.locator(".exlnb-record .exlnb-tree")
    expect(tree).to_be_visible(timeout=60_000)
    assert [t for t in tree.locator(".exlnb-chain").all_inner_texts() if t.strip()] == SEEN["texts"]
    expect(tree.locator(".exlnb-tree-off")).to_be_visible()  # a record: growing it needs the live kernel
    expect(tree.locator(".exlnb-tree-actions")).to_be_hidden()
    row = tree.locator("details.exlnb-tree-item:not(.exlnb-leaf) > summary").first
    row.click()  # a record folds with no kernel and no script
    assert not row.evaluate("el => el.parentElement.open")
    assert "model not found" not in cell.inner_text()
    tree.screenshot(path=str(ARTIFACTS / "tree-record-light.png"))

    subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", str(root / "face.ipynb")],
        check=True,
        capture_output=True,
    )
    shown = html.unescape(re.sub(r"<[^>]+>", "", (root / "face.html").read_text()))
    assert "8 samples (+" in shown and all(text in shown for text in SEEN["texts"][:5])
