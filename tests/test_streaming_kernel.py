"""exlnb's output in a real ipykernel: a kernel interrupt stops a `%%exl_generate` cell at once, whether the
answer shows as a widget or as text, and `%exl_load` leaves no widget behind.

Driven through a real ipykernel, interrupted as JupyterLab interrupts it (jupyter_client's `interrupt_kernel`,
SIGINT), in a kernel without a widget front end (as papermill and nbclient start one). ipykernel's SIGINT
handler only schedules the cancel on the kernel's event loop: a cell that blocks that loop is heard only once
it has ended, so a cell that is cancelled before its last token shows that the loop kept running.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow  # a real kernel

pytest.importorskip("jupyter_client", reason="the kernel tests need the notebook stack: pip install -e '.[test]'")

from docs.bad_inputs import Kernel, Reply  # noqa: E402 - the one driver of a real kernel, shared with docs/bad-inputs.md

TOKENS = 400  # min = max: the answer cannot end on its own before the interrupt comes
CELL = (
    f"%%exl_generate --display {{display}} --max-new-tokens {TOKENS} --min-new-tokens {TOKENS} --seed 1\n"
    "Tell me a very long story about a dragon who learns to bake bread."
)


@pytest.fixture(scope="module")
def kernel():
    """A kernel with the bundled model loaded on the CPU engine, started without a Jupyter server."""
    kernel = Kernel()
    try:
        reply = kernel.execute("%load_ext exlnb\n%exl_load --engine cpu")
        assert reply.error is None, reply.error
        yield kernel
    finally:
        kernel.close()


def tokens_shown(reply: Reply) -> bool:
    """Some of the answer is on the screen: streamed text, or a widget's count above zero."""
    drawn = re.search(r"(\d+)/\d+ tokens", reply.widget_html)
    return len(reply.stdout.strip()) > 20 or (drawn is not None and int(drawn.group(1)) > 0)


@pytest.mark.parametrize("display", ["text", "auto", "widget"])  # auto: text, as papermill's kernels show it
def test_an_interrupt_stops_the_cell_whatever_the_display(kernel, display):
    reply = kernel.execute(CELL.format(display=display), interrupt_when=tokens_shown)

    assert reply.error is not None, f"the cell ran to its end: {reply.stdout[-300:]}"
    assert reply.error["ename"] == "Interrupted"
    line = re.fullmatch(r"interrupted: job \d+ cancelled after (\d+) tokens", reply.error["evalue"])
    assert line is not None, reply.error["evalue"]
    tokens = int(line.group(1))
    assert 0 < tokens < TOKENS
    status = (reply.record if display == "widget" else reply.stdout).strip().splitlines()[-1]
    assert f" {tokens} tokens" in status, status  # one count, said in the status and the interrupt line
    assert "cancelled (interrupted)" in status
    left = kernel.execute("from exlnb import get_session\nprint(len(get_session().jobs()))")
    assert left.stdout.strip() == "0"


def test_loading_a_model_leaves_no_widget_in_the_notebook(kernel):
    reply = kernel.execute("%exl_load --engine cpu --reload")

    assert reply.error is None, reply.error
    assert reply.widgets == 0, "a progress bar was shown as a widget: reopened, it reads 'Error displaying widget'"
    assert "cpu engine" in reply.stdout
