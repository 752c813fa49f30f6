"""The magics in a real IPython shell, on the real bundled model and CPU engine: options reach the Python API,
samples run concurrently, chats keep (or forget) their turns, no job outlives a Stop or a Ctrl-C, and a
notebook run by papermill shows the answer as plain output."""

from __future__ import annotations

import _thread
import threading
import time

import pytest
from IPython.core.error import UsageError

import exlnb.magics
from exlnb import EosReason
from exlnb.chat import forget_chat, get_chat
from exlnb.generation import start
from exlnb.widgets.stream import generate_live
from tests.helpers import wait_until_idle

nbformat = pytest.importorskip(
    "nbformat", reason="the notebook tests need the notebook stack: pip install -e '.[test]'"
)
papermill = pytest.importorskip(
    "papermill", reason="the notebook tests need the notebook stack: pip install -e '.[test]'"
)

QUESTION = "What is the capital of France?"
LOOPING = "Write a chant for a football team."  # greedy, no penalty: "The team of the team of ..." by token 40


@pytest.fixture
def idle(cpu_session):
    assert cpu_session.jobs() == []
    yield cpu_session
    cpu_session.cancel_all()


def generate(shell, line: str, body: str = QUESTION):
    """Run a %%exl_generate cell; the value its --out variable holds."""
    shell.run_cell_magic("exl_generate", f"{line} --out result", body)
    return shell.user_ns.pop("result")


@pytest.mark.parametrize(
    ("option", "keyword", "value"),
    [
        ("--system 'Answer in French.'", "system", "Answer in French."),
        ("--template raw", "template", "raw"),
        ("--max-new-tokens 3", "max_new_tokens", 3),
        ("--temperature 0.5", "temperature", 0.5),
        ("--top-k 7", "top_k", 7),
        ("--top-p 0.5", "top_p", 0.5),
        ("--min-p 0.1", "min_p", 0.1),
        ("--rep-penalty 1.11", "token_repetition_penalty", 1.11),
        ("--freq-penalty 0.03", "token_frequency_penalty", 0.03),
        ("--presence-penalty 0.2", "token_presence_penalty", 0.2),
        ("--seed 9", "seed", 9),
        ("--stop Paris --stop '\\n'", "stop", ["Paris", "\n"]),
        ("--n 2", "n", 2),
        ("--chat options-test", "chat", "options-test"),
        ("--chat options-test --amnesia", "amnesia", True),
        ("--background", "background", True),
        ("--loop-guard", "loop_guard", True),
        ("--show-prompt", "show_prompt", True),
        ("--display text", "display", "text"),
        ("--tokens 3", "tokens", 3),
        ("--tokens 2 --show-whitespace", "show_whitespace", True),
        ("--tokens 2 --token-colour latency", "token_colour", "latency"),
        ("--regex '[0-9]{2}'", "regex", "[0-9]{2}"),
    ],
)
def test_every_generate_option_reaches_the_api(shell, idle, monkeypatch, option, keyword, value):
    calls = []

    def recording(request, **show):
        calls.append((request, show))
        return generate_live(request.with_options(max_new_tokens=min(request.max_new_tokens, 4)), **show)

    monkeypatch.setattr(exlnb.magics, "generate_live", recording)
    shell.run_cell_magic("exl_generate", f"{option} --out result", QUESTION)
    generation = shell.user_ns.pop("result")
    if keyword == "background":
        generation.wait(60)
    forget_chat("options-test")

    request, show = calls[0]
    if keyword in show:
        actual = show[keyword]
    else:
        actual = getattr(request, keyword) if hasattr(request, keyword) else getattr(request.sampler, keyword)
    assert actual == (tuple(value) if keyword == "stop" else value)


def test_a_misspelt_option_names_the_closest_and_points_to_the_help(shell, idle, cpu_session):
    with pytest.raises(UsageError) as magic_error:
        shell.run_cell_magic("exl_generate", "--temprature 0.5", QUESTION)
    assert str(magic_error.value) == (
        "%%exl_generate: unknown option --temprature (did you mean --temperature?); "
        "%%exl_generate --help lists the options"
    )
    with pytest.raises(TypeError, match=r"unknown option 'temprature' \(did you mean 'temperature'\?\).*top_p"):
        cpu_session.generate(QUESTION, temprature=0.5)
    with pytest.raises(TypeError, match=r"unknown option 'temprature'"):
        start(QUESTION, temprature=0.5)
    assert cpu_session.jobs() == []


def test_generate_help_shows_every_option_with_its_default(shell, capsys):
    shell.run_cell("%exl_generate?")
    shown = capsys.readouterr().out
    shell.run_line_magic("exl_generate", "--help")
    by_flag = capsys.readouterr().out

    assert not shown.lstrip().startswith("::")
    for text in (shown, by_flag):
        assert "--max-new-tokens N" in text and "(default: 256)" in text
        assert "--temperature X" in text and "(default: 0.8)" in text
        assert "--rep-penalty" in text and "(default: 1.025)" in text


def test_exl_load_options_reach_the_session(shell, cpu_session, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(
        cpu_session, "load", lambda model, **options: calls.append((model, options)) or cpu_session.status()
    )
    shell.run_line_magic(
        "exl_load",
        "smollm2-135m-instruct --engine cpu --cache-tokens 4096 --cache q8 --max-batch-size 8 "
        "--gpu-split 20,24 --graphs off --tensor-parallel --reload",
    )

    model, options = calls[0]
    assert model == "smollm2-135m-instruct"
    given = dict(
        engine="cpu",
        cache_tokens=4096,
        cache="q8",
        max_batch_size=8,
        gpu_split=[20.0, 24.0],
        graphs="off",
        tensor_parallel=True,
        reload=True,
    )
    assert {k: options[k] for k in given} == given
    assert "cpu engine | smollm2-135m-instruct" in capsys.readouterr().out  # the one-line status


def test_exl_load_with_the_same_arguments_does_nothing(shell, cpu_session, capsys):
    shell.run_line_magic("exl_load", "--engine cpu")  # whatever an earlier test loaded
    engine = cpu_session._engine_thread().engine
    shell.run_line_magic("exl_load", "--engine cpu")
    assert cpu_session._engine_thread().engine is engine
    printed = capsys.readouterr().out
    assert "paged" in printed
    # what a server of the same model is started on (the bundled model's lives in the user cache)
    assert f"\nmodel folder: {cpu_session.options.model_dir}\n" in printed


def test_bad_options_are_usage_errors_not_tracebacks(shell, idle):
    with pytest.raises(UsageError, match="--gpu-split 'x'"):
        shell.run_line_magic("exl_load", "--gpu-split x")
    with pytest.raises(UsageError, match="temperature=-1.0 is out of range"):
        shell.run_cell_magic("exl_generate", "--temperature -1", QUESTION)
    with pytest.raises(UsageError, match="no variable 'city'"):
        shell.run_cell_magic("exl_generate", "", "Where is {city}?")
    with pytest.raises(UsageError, match="name the jobs to cancel"):
        shell.run_line_magic("exl_cancel", "")


@pytest.mark.parametrize(
    "name, value, field, problem",
    [
        ("k", 5, "k[0]", "k (int): 'int' object is not subscriptable (TypeError)"),
        ("k", [1], "k[3]", "k (list): list index out of range (IndexError)"),
        ("k", {}, "k[missing]", "k (dict): it has no key 'missing' (KeyError)"),
        ("k", 5, "k.colour", "k (int): 'int' object has no attribute 'colour' (AttributeError)"),
    ],
)
def test_a_prompt_name_that_cannot_be_filled_says_what_the_variable_holds(shell, idle, name, value, field, problem):
    shell.user_ns[name] = value
    with pytest.raises(UsageError) as raised:
        shell.run_cell_magic("exl_generate", "--max-new-tokens 2", f"Tell me about {{{field}}}.")
    assert str(raised.value) == (
        f"the prompt's {{{field}}} could not be filled from {problem}; write {{{{ and }}}} for literal braces"
    )
    assert idle.jobs() == []


def test_greedy_answer_with_result_object_and_stats(shell, idle, capsys):
    result = generate(shell, "--temperature 0 --max-new-tokens 24")

    assert "Paris" in result.text
    assert result.eos_reason is EosReason.STOP_TOKEN
    assert result.token_ids and result.new_tokens == len(result.token_ids)
    assert result.time_to_first_token_s > 0 and result.decode_tokens_per_s > 0
    out = capsys.readouterr().out
    assert result.text in out and "TTFT" in out and "ended: end of turn" in out  # plain output: text, then stats


def test_prompt_names_are_filled_from_the_notebook(shell, idle):
    shell.user_ns["country"] = "France"
    result = generate(shell, "--temperature 0 --max-new-tokens 24", "What is the capital of {country}?")
    assert "Paris" in result.text


def test_stop_string_ends_the_answer_before_it(shell, idle):
    result = generate(shell, "--temperature 0 --max-new-tokens 24 --stop Paris")
    assert result.eos_reason is EosReason.STOP_STRING and "Paris" not in result.text


def test_show_prompt_marks_the_special_tokens(shell, idle, capsys):
    generate(shell, "--template chatml --system 'Be brief.' --max-new-tokens 2 --show-prompt")
    out = capsys.readouterr().out
    assert "⟦<|im_start|>⟧system\nBe brief.⟦<|im_end|>⟧" in out


def test_n_4_runs_four_jobs_at_once(shell, idle):
    generation = generate(shell, "--n 4 --seed 1 --max-new-tokens 40 --background")
    seen = 0
    deadline = time.monotonic() + 60
    while not generation.done and time.monotonic() < deadline:
        seen = max(seen, sum(r.info.stage.value == "decode" for r in idle.jobs()))
        time.sleep(0.01)
    results = generation.wait(60)

    assert seen == 4  # all four decoding in the same steps
    assert len({r.job_id for r in results}) == 4
    assert len({r.text for r in results}) > 1  # seeds 1, 2, 3, 4


def test_chat_keeps_history_and_amnesia_clears_it(shell, idle):
    forget_chat("trip")
    first = generate(shell, "--chat trip --temperature 0 --max-new-tokens 12", "I am planning a trip to Rome.")
    second = generate(shell, "--chat trip --temperature 0 --max-new-tokens 12", "What should I pack?")
    assert len(get_chat("trip").turns) == 4
    assert second.prompt_tokens > first.prompt_tokens + 12  # the first exchange is in the context

    fresh = generate(shell, "--chat trip --amnesia --temperature 0 --max-new-tokens 12", "What should I pack?")
    assert len(get_chat("trip").turns) == 2
    assert fresh.prompt_tokens < second.prompt_tokens
    forget_chat("trip")


def test_loop_guard_cancels_a_looping_sample_and_says_so(shell, idle, capsys):
    result = generate(shell, "--loop-guard --temperature 0 --rep-penalty 1.0 --max-new-tokens 160", LOOPING)

    assert result.eos_reason is EosReason.CANCELLED and result.new_tokens < 160
    assert "(loop guard)" in capsys.readouterr().out
    assert idle.jobs() == []


def test_rerunning_a_cell_cancels_what_it_started(idle):
    first = start(QUESTION, max_new_tokens=400, owner="cell-7", temperature=1.0, stop=[])
    second = start(QUESTION, max_new_tokens=2, owner="cell-7")
    second.wait(60)
    first.wait(60)
    assert first.samples[0].stopped_by == "re-run"
    assert first.results[0].eos_reason is EosReason.CANCELLED


def test_keyboard_interrupt_while_waiting_cancels_the_samples(shell, idle, ctrl_c):
    started = threading.Event()
    original = exlnb.magics.generate_live

    def interrupted(prompt, **options):
        def watch():
            while not idle.jobs():
                time.sleep(0.005)
            started.set()
            time.sleep(0.3)
            _thread.interrupt_main()  # Ctrl-C while the cell waits for its samples

        threading.Thread(target=watch, daemon=True).start()
        return original(prompt, **options)

    exlnb.magics.generate_live = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            # 400 tokens each: samples that ended within the watcher's 0.3 s would take its Ctrl-C after the cell
            options = "--n 2 --max-new-tokens 400 --min-new-tokens 400 --display text"
            shell.run_cell_magic("exl_generate", options, QUESTION)
    finally:
        exlnb.magics.generate_live = original
    assert started.is_set()
    wait_until_idle(idle)
    assert idle.jobs() == []


def test_an_interrupted_cell_still_stores_its_samples_with_out(shell, idle):
    """Stop stored `--out`, a kernel interrupt did not: the samples as they ended were lost with the cell."""
    import asyncio

    from IPython.utils.capture import capture_output

    from exlnb.magics import await_magic_cells

    code = f"%%exl_generate --n 2 --max-new-tokens 400 --min-new-tokens 400 --display text --out cut\n{QUESTION}"
    transformed = "".join(await_magic_cells(shell.transform_cell(code).splitlines(keepends=True)))

    async def interrupt_cell():
        task = asyncio.ensure_future(shell.run_cell_async(code, store_history=False, transformed_cell=transformed))
        while not any(row.info.new_tokens for row in idle.jobs()):
            assert not task.done(), task.result().error_in_exec
            await asyncio.sleep(0.01)
        task.cancel()  # what ipykernel does on an interrupt while a cell awaits
        return await task

    with capture_output():
        outcome = asyncio.run(interrupt_cell())
    cut = shell.user_ns.pop("cut")
    assert type(outcome.error_in_exec).__name__ == "Interrupted"
    assert [r.eos_reason for r in cut] == [EosReason.CANCELLED] * 2 and all(0 < r.new_tokens < 400 for r in cut)
    wait_until_idle(idle)


def test_cache_and_jobs_magics_print_text_without_a_widget_front_end(shell, idle, capsys):
    # no end of sequence before 400 tokens: a sample at temperature 1 once ended by itself before the cancel
    generation = start(QUESTION, n=2, max_new_tokens=400, min_new_tokens=400, temperature=1.0)
    deadline = time.monotonic() + 60  # the views are published after each step: wait for both to decode
    while [r.info.stage.value for r in idle.jobs()] != ["decode"] * 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    shell.run_line_magic("exl_cache", "")
    shell.run_line_magic("exl_jobs", "")
    shell.run_line_magic("exl_cancel", "--all")
    generation.wait(30)
    out = capsys.readouterr().out

    assert "pages in use" in out and "256-token pages" in out
    assert "job" in out and "decode" in out and "stream read" in out
    assert "cancelled 2 jobs" in out


@pytest.mark.slow  # a kernel under papermill
def test_papermill_run_shows_the_answer_as_plain_output(tmp_path):
    cells = [
        "%load_ext exlnb",
        "%exl_load --engine cpu",
        f"%%exl_generate --temperature 0 --max-new-tokens 24\n{QUESTION}",
        "%exl_cache",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, tmp_path / "in.ipynb")

    papermill.execute_notebook(tmp_path / "in.ipynb", tmp_path / "out.ipynb", kernel_name="python3", progress_bar=False)

    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    text = ["".join(o.get("text", "") for o in cell.outputs) for cell in executed.cells]
    assert "cpu engine" in text[1]
    assert "Paris" in text[2] and "ended: end of turn" in text[2]
    assert "pages in use" in text[3]
    # no front end to render widgets: the stream and the inspector are plain text
    assert not [
        o
        for cell in executed.cells[2:]
        for o in cell.outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
