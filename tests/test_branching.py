"""Branching a finished answer from one of its tokens, on the real bundled model and CPU engine: the branch
reproduces the answer when it forces the token the model chose, starts with another one when forced, reuses the
prompt's cached pages, and the branches form a tree; bad input fails in one line."""

from __future__ import annotations

import html
import subprocess
import sys
import time

import pytest
from IPython.core.error import UsageError

from exlnb import BranchTree, EosReason
from exlnb.generation import start

QUESTION = "Name three colours of the rainbow."
AT = 5


def answer(prompt: str = QUESTION, **options):
    options = {"temperature": 0, "max_new_tokens": 24, "tokens": 3, **options}
    return start(prompt, **options).wait()[0]


@pytest.fixture(scope="module")
def greedy_answer(cpu_session):
    return answer()


def test_greedy_branch_with_the_chosen_token_reproduces_the_answer(cpu_session, greedy_answer):
    original = greedy_answer
    branch = original.branch(at=AT, token=original.token_ids[AT])
    assert branch.token_ids == original.token_ids[AT:]
    assert branch.text == cpu_session.tokenizer.decode(original.token_ids[AT:])
    assert branch.eos_reason == original.eos_reason


def test_branch_forced_to_another_token_starts_with_it_and_keeps_the_budget(cpu_session, greedy_answer):
    original = greedy_answer
    alternative = next(i for i, _t, _p in original.token_records[AT].info.alternatives if i != original.token_ids[AT])
    branch = original.branch(at=AT)  # default: the token view's likeliest alternative
    forced_text = cpu_session.tokenizer.decode([alternative])
    assert branch.token_ids[0] == alternative
    assert branch.text.startswith(forced_text)
    assert branch.token_ids != original.token_ids[AT:]
    assert len(branch.token_ids) <= 24 - AT  # max_new_tokens minus the tokens kept
    by_text = original.branch(at=AT, token=forced_text)
    assert by_text.token_ids == branch.token_ids  # greedy: the same forced token gives the same branch


def test_branch_reuses_the_prompts_cached_pages(cpu_session):
    page_size = cpu_session.cache_view().page_size
    long_prompt = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "cherry"] * 60) + ". Which is red?"
    original = answer(long_prompt, max_new_tokens=8)
    prompt_ids = original.origin.prompt_ids
    assert len(prompt_ids) > page_size
    branch = original.branch(at=2, token=original.token_ids[2])
    assert branch.prompt_tokens == len(prompt_ids) + 3  # the prompt, two kept tokens and the forced one
    assert branch.cached_tokens >= page_size * (len(prompt_ids) // page_size)
    assert branch.token_ids == original.token_ids[2:]


def test_branches_form_a_tree(cpu_session):
    original = answer(max_new_tokens=16)
    first = original.branch(at=3)
    second = first.branch(at=2, token=" blue")
    sibling = original.branch(at=1, token=original.token_ids[1])
    tree = BranchTree.of(second)
    assert [n.parent for n in tree.nodes] == [None, 0, 1, 0]
    assert [n.position for n in tree.nodes] == [None, 3, 2, 1]
    assert [n.job_id for n in tree.nodes] == [r.job_id for r in (original, first, second, sibling)]
    assert tree.nodes[2].forced_text == " blue" and tree.nodes[2].forced_token == second.token_ids[0]
    assert [n.text for n in tree.nodes] == [r.text for r in (original, first, second, sibling)]
    assert [n.end for n in tree.nodes] == [r.eos_reason.words for r in (original, first, second, sibling)]
    assert second.origin.parent is first and first.origin.parent is original
    assert "← #1 at 2, forced ' blue'" in tree.text()
    html = tree._repr_mimebundle_()["text/html"]
    assert html.count("<tr>") == 5 and "exlnb-branches" in html and "&#x27; blue&#x27;" in html


def test_the_tree_shows_what_each_branch_kept_and_the_token_its_forced_one_replaced(cpu_session):
    """The tree showed only a branch's continuation: not where it left its parent, nor what it replaced."""
    original = answer(max_new_tokens=12)
    branch = original.branch(at=4)
    decode = cpu_session.tokenizer.decode
    [_, node] = BranchTree.of(branch).nodes

    assert node.kept == decode(original.token_ids[:4]) and node.replaced == decode([original.token_ids[4]])
    assert node.text == branch.text  # the branch's own text, as its result has it
    line = BranchTree.of(branch).text().splitlines()[1]
    assert line.endswith(f"in place of {node.replaced!r} [{node.end}]: {node.kept!r} + {branch.text!r}")
    row = BranchTree.of(branch).html().split("<tr>")[-1]
    kept, forced = html.escape(node.kept), html.escape(node.forced_text)
    assert f'<span class="exlnb-kept exlnb-muted">{kept}</span><span class="exlnb-forced">{forced}</span>' in row


def test_a_tree_shown_outside_a_notebook_prints_its_text():
    """In a terminal, `BranchTree.show()` printed its HTML bundle as a dict."""
    code = (
        "from exlnb.widgets.branches import BranchNode, BranchTree\n"
        "BranchTree((BranchNode(0, 1, None, None, None, None, 'Blue sky.', 'end of turn'),\n"
        "            BranchNode(1, 2, 0, 1, 9, ' red', ' red sky.', 'end of turn', 'Blue', ' sky'))).show()"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown == (
        "#0 job 1 [end of turn]: 'Blue sky.'\n"
        "#1 job 2 ← #0 at 1, forced ' red' (9) in place of ' sky' [end of turn]: 'Blue' + ' red sky.'\n"
    )


@pytest.mark.parametrize(
    "at, token, message",
    [
        (24, None, "at=24 is not a position of job"),
        (-1, None, "at=-1 is not a position of job"),
        (AT, 10**7, "token=10000000 is not in the vocabulary: give an id from 0 to"),
        (AT, " rainbow colours", "is 2 tokens"),
        (AT, "", "is 0 tokens"),
    ],
)
def test_bad_branch_input_is_refused_in_one_line(greedy_answer, at, token, message):
    with pytest.raises(ValueError, match=message) as raised:
        greedy_answer.branch(at=at, token=token)
    assert "\n" not in str(raised.value)


def drawings_until(drawn: list, done, timeout_s: float = 60) -> list:
    """What was drawn, once `done(drawn)` holds (the chooser branches on a thread of its own)."""
    deadline = time.monotonic() + timeout_s
    while not done(drawn):
        assert time.monotonic() < deadline, f"not drawn in {timeout_s} s: {drawn[-1:]}"
        time.sleep(0.02)
    return drawn


def test_choosing_an_alternative_in_the_token_view_branches_there_and_draws_the_tree_under_it(cpu_session, monkeypatch):
    import IPython.display

    from exlnb.widgets.branches import BranchChoices, branch_key

    drawn = []
    monkeypatch.setattr(IPython.display, "update_display", lambda data, **kwargs: drawn.append((data, kwargs)))
    generation = start(QUESTION, temperature=0, max_new_tokens=16, tokens=3)
    choices = BranchChoices(generation)
    [original] = generation.wait(60)
    key = branch_key(generation.samples[0])
    alternative = next(i for i, _t, _p in original.token_records[AT].info.alternatives if i != original.token_ids[AT])

    choices.handle({"type": "branch", "answer": key, "at": AT, "token": alternative})  # what view.js sends

    def ended(drawings) -> bool:
        return original.origin.family and drawings[-1][0]["text/plain"] == BranchTree.of(original).text()

    drawings_until(drawn, ended)  # the last drawing is the tree that `result.branch()` keeps too
    assert {kwargs["display_id"] for _data, kwargs in drawn} == {choices.display_id}
    forced = cpu_session.tokenizer.decode([alternative])
    first = drawn[0][0]["text/plain"]  # drawn once the branch has started, whether or not it has ended since
    assert f"#1 job {original.origin.family[0].job_id} ← #0 at {AT}, forced {forced!r} ({alternative})" in first
    tree = BranchTree.of(original)
    assert len(tree.nodes) == 2 and "exlnb-branches" in drawn[-1][0]["text/html"]
    same = original.branch(at=AT, token=alternative)  # the plain API: greedy, so the same branch
    assert tree.nodes[1].text == same.text and tree.nodes[1].end == same.eos_reason.words


@pytest.mark.parametrize(
    "at, token, message",
    [
        (99, None, "not branched: at=99 is not a position of job"),
        (AT, 10**7, "not branched: token=10000000 is not in the vocabulary"),
    ],
)
def test_a_choice_that_cannot_branch_says_why_under_the_view_in_one_line(cpu_session, monkeypatch, at, token, message):
    import IPython.display

    from exlnb.widgets.branches import BranchChoices, branch_key

    drawn = []
    monkeypatch.setattr(IPython.display, "update_display", lambda data, **kwargs: drawn.append(data))
    generation = start(QUESTION, temperature=0, max_new_tokens=8, tokens=3)
    choices = BranchChoices(generation)
    [original] = generation.wait(60)
    token = original.token_records[0].info.alternatives[1][0] if token is None else token

    choices.handle({"type": "branch", "answer": branch_key(generation.samples[0]), "at": at, "token": token})
    [refused] = drawings_until(drawn, bool)
    assert message in refused["text/plain"] and "\n" not in refused["text/plain"]
    assert "exlnb-warning" in refused["text/html"] and original.origin.family == []


def test_a_result_without_its_request_cannot_branch(cpu_session):
    from exlnb.engines.base import JobSpec

    plain = cpu_session.submit(JobSpec(input_ids=(1, 2, 3), max_new_tokens=4)).result()
    with pytest.raises(ValueError, match="does not keep its request"):
        plain.branch(at=1)


def test_a_result_of_another_loaded_model_cannot_branch(cpu_session, greedy_answer):
    cpu_session.load("smollm2-135m-instruct", engine="cpu", cache_tokens=4096, progress=False)
    with pytest.raises(ValueError, match=r"but smollm2-135m-instruct \(cpu\) is loaded now: load that model again"):
        greedy_answer.branch(at=AT)


def test_branch_magic_streams_stores_and_shows_the_tree(shell, cpu_session, greedy_answer, capsys):
    shell.user_ns["answer"] = greedy_answer
    shell.run_line_magic(
        "exl_branch", f"answer --at {AT} --token-id {greedy_answer.token_ids[AT]} --display text --out branched"
    )
    branched = shell.user_ns.pop("branched")
    assert branched.token_ids == greedy_answer.token_ids[AT:]
    printed = capsys.readouterr().out
    assert branched.text.strip() in printed
    assert f"← #0 at {AT}" in printed


@pytest.mark.parametrize(
    "line, message",
    [
        ("nothing --at 1", "nothing does not name a result in the notebook \\(NameError"),
        ("answer.text --at 1", "answer.text is a str, not a result"),
        ("answer --at 99", "at=99 is not a position"),
        ("answer --at 1 --token a --token-id 3", "not both"),
    ],
)
def test_branch_magic_mistakes_are_one_line(shell, greedy_answer, line, message):
    shell.user_ns["answer"] = greedy_answer
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("exl_branch", line)


def test_branch_magic_in_a_kernel_awaits_so_its_stop_button_is_heard(shell, greedy_answer, monkeypatch):
    import asyncio

    import IPython.display
    from IPython.utils.capture import capture_output

    from exlnb.magics import await_magic_cells
    from exlnb.widgets.stream import StreamView

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kwargs: shown.append(obj))
    shell.user_ns["answer"] = greedy_answer
    code = f"%exl_branch answer --at {AT} --display widget --out stopped"
    transformed = "".join(await_magic_cells(shell.transform_cell(code).splitlines(keepends=True)))
    assert transformed.startswith("await ") and "exl_branch_async" in transformed

    async def cell():
        task = asyncio.ensure_future(shell.run_cell_async(code, store_history=False, transformed_cell=transformed))
        while not shown:
            assert not task.done(), task.result().error_in_exec
            await asyncio.sleep(0.01)
        shown[0].handle({"type": "stop"})  # the Stop button, heard while the cell awaits
        return await task

    with capture_output(stdout=False, stderr=False):
        outcome = asyncio.run(cell())
    assert outcome.error_in_exec is None
    view, stopped = shown[0], shell.user_ns.pop("stopped")
    assert isinstance(view, StreamView) and view.settled
    assert stopped.eos_reason is EosReason.CANCELLED and len(stopped.token_ids) < 24 - AT
    assert view.generation.samples[0].stopped_by == "stop button"


def test_a_cell_run_again_closes_the_chooser_of_its_last_run_and_frees_its_answers(cpu_session):
    """`%%exl_generate --tokens` keeps the answers a token view can branch alive: its comm and generation. The
    same cell run again replaced that view, so its chooser goes, token view or not; another cell's stays."""
    from exlnb.widgets.branches import BranchChoices, branch_key

    first, other, again = (start(QUESTION, temperature=0, max_new_tokens=4, tokens=2) for _ in range(3))
    choosers = [BranchChoices.offer(g, owner) for g, owner in ((first, "cell-a"), (other, "cell-b"), (again, "cell-a"))]
    for generation in (first, other, again):
        generation.wait(60)

    assert choosers[0].comm is None and branch_key(first.samples[0]) is None  # closed: its view was replaced
    assert choosers[1].comm is not None and branch_key(other.samples[0]) is not None
    assert choosers[2].comm is not None and branch_key(again.samples[0]) is not None
    plain = start(QUESTION, max_new_tokens=1)
    assert BranchChoices.offer(plain, "cell-b") is None  # cell b again, without a token view: nothing to hold
    plain.wait(60)
    assert choosers[1].comm is None and branch_key(other.samples[0]) is None
    choosers[2].close()
