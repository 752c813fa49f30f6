"""docs/bad-inputs.md is what the code does: every case of `docs.bad_inputs.CASES` is typed into a real ipykernel
again and the table must come out the same, each row a one-line message, and the session still answering after
each. A change in what a bad input gets fails here until `python docs/bad_inputs.py` regenerates the page."""

from __future__ import annotations

import pytest

pytest.importorskip("jupyter_client", reason="the kernel tests need the notebook stack: pip install -e '.[test]'")

from docs import bad_inputs  # noqa: E402 - after the skip: it starts kernels with jupyter_client

pytestmark = pytest.mark.slow  # a real kernel


def test_every_bad_input_in_a_real_kernel_gets_what_the_committed_table_says_and_harms_nothing():
    results = bad_inputs.run_cases()
    committed = bad_inputs.TABLE.read_text()
    generated = bad_inputs.markdown(results)

    stale = [line for line in generated.splitlines() if line.startswith("| `") and line not in committed]
    assert not stale and generated == committed, (
        "docs/bad-inputs.md is out of date (run python docs/bad_inputs.py); rows that changed:\n" + "\n".join(stale)
    )
    harmful = [
        (shown, seen, usable)
        for shown, seen, usable in results
        if seen.startswith("TRACEBACK") or seen == "(no error)" or not usable.startswith("yes")
    ]
    assert not harmful, harmful
