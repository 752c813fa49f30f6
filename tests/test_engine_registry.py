"""The engine registry: one declaration per engine that `auto`, the errors, `%exl_load --engine` and docs/engines.md
read; and docs/architecture.md's recipe followed to the letter (tests/toy_engine.py), run through the Python API,
the magics, the widgets, the records of results (the investigations' and the benchmarks') and `report --publish`
with nothing registered but its declaration."""

from __future__ import annotations

import importlib
import json
import re
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from benchmarks import harness
from exlnb import SamplerSettings, report
from exlnb.engines import registry
from exlnb.engines.base import Engine
from exlnb.engines.formats import engine_for
from exlnb.engines.registry import engine_names, engine_spec, engines_table, register_engine, unregister_engine
from exlnb.experiments.record import environment
from exlnb.generation import start
from exlnb.session import get_session
from exlnb.widgets.cache import CacheInspector, JobTable
from exlnb.widgets.stream import StreamView
from tests.toy_engine import TOY_SPEC

ROOT = Path(__file__).resolve().parents[1]
ENGINES_DOC = ROOT / "docs" / "engines.md"
PROMPT = "one two three four"


@pytest.fixture
def registered():
    """The registry as it was is restored afterwards, so no other test sees what a test registered."""
    before = [engine_spec(name) for name in engine_names()]
    yield register_engine
    for name in engine_names():
        unregister_engine(name)
    for spec in before:
        register_engine(spec)


def test_an_unknown_engine_names_every_registered_one(registered):
    registered(TOY_SPEC)

    with pytest.raises(ValueError, match=r"unknown engine 'nope': choose one of auto, .*cpu.*toy"):
        engine_spec("nope")


def test_a_declaration_with_an_unknown_capability_is_refused():
    with pytest.raises(ValueError, match=r"unknown capabilities telepathy: choose from paged"):
        replace(TOY_SPEC, capabilities=frozenset({"telepathy"}))


def test_auto_reads_the_registry_rank_and_cuda_need(registered):
    registered(replace(TOY_SPEC, name="fast-exl2", loads=("exl2",), auto_rank=0))

    assert engine_for("exl2", cuda=False) == "fast-exl2"
    assert engine_for("exl2", cuda=True) == "fast-exl2"
    assert engine_for("hf", cuda=True) == "exllamav2"


def test_auto_never_picks_an_engine_without_a_rank(registered):
    registered(replace(TOY_SPEC, loads=("exl3",)))

    with pytest.raises(ValueError, match="EXL3 models run on the exllamav3 engine, which needs a CUDA GPU"):
        engine_for("exl3", cuda=False)


def test_auto_without_a_ranked_engine_names_those_that_load_the_format(registered):
    unregister_engine("openai")  # put back by the fixture
    registered(replace(TOY_SPEC, loads=("url",)))

    with pytest.raises(ValueError, match=r"no engine is chosen automatically for url: name one with engine= \(toy\)"):
        engine_for("url", cuda=True)


def test_registering_a_name_again_replaces_it_in_place(registered):
    registered(TOY_SPEC)
    registered(replace(TOY_SPEC, summary="another toy"))

    assert engine_names().count("toy") == 1 and engine_spec("toy").summary == "another toy"


@pytest.mark.parametrize("name", engine_names())
def test_each_declaration_agrees_with_its_engine_class(name):
    spec = engine_spec(name)
    module, _, class_name = spec.engine_class.partition(":")
    engine_class = getattr(importlib.import_module(module), class_name)  # no CUDA library: they load in __init__

    assert engine_class.name == name
    assert spec.can("loop_guard") == engine_class.loop_guard_by_engine
    assert spec.can("prompt_passes") == bool(engine_class.prompt_passes)
    assert spec.can("scoring") == (engine_class.score is not Engine.score)


def test_the_engines_table_in_the_docs_is_the_registry_s():
    table = engines_table()
    committed = ENGINES_DOC.read_text()

    assert table in committed, "docs/engines.md's table is stale: call exlnb.engines.registry.write_engines_doc()"
    for name in engine_names():
        assert f"`{name}`" in table
    for capability in registry.CAPABILITIES:
        assert f"`{capability}`" in committed


def test_the_readme_s_engine_table_names_every_registered_engine_in_order():
    section = (ROOT / "README.md").read_text().split("\n## The engines\n")[1].split("\n## ")[0]

    assert re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE) == list(engine_names())


def test_writing_the_engines_doc_replaces_only_a_stale_table(tmp_path):
    doc = tmp_path / "engines.md"
    doc.write_text(f"# Engines\n{registry.TABLE_START}\n| stale |\n{registry.TABLE_END}\nafter\n")

    registry.write_engines_doc(doc)

    assert doc.read_text() == f"# Engines\n{registry.TABLE_START}\n{engines_table()}{registry.TABLE_END}\nafter\n"


def test_the_engines_table_changes_with_a_declaration(registered):
    before = engines_table()
    registered(TOY_SPEC)

    assert engines_table() != before and "`toy`" in engines_table()


# -- the toy engine, through every layer ------------------------------------------------------------------------


TOY_LOAD = dict(engine="toy", cache_tokens=65536, progress=False)  # %exl_load --engine toy --cache-tokens 65536


@pytest.fixture(scope="module")
def toy_loaded():
    """The toy engine registered and loaded into the kernel's session once for these tests; afterwards the CPU
    engine is loaded again and the toy unregistered, as if it had never been."""
    register_engine(TOY_SPEC)
    session = get_session()
    session.load("smollm2-135m-instruct", **TOY_LOAD)
    yield session
    session.load("smollm2-135m-instruct", engine="cpu", progress=False)
    unregister_engine("toy")


@pytest.fixture
def toy(toy_loaded):
    """The toy loaded (again, where a test loaded something else) and idle."""
    toy_loaded.load("smollm2-135m-instruct", **TOY_LOAD)
    yield toy_loaded
    toy_loaded.cancel_all()


def echo(session, prompt: str, count: int) -> tuple[list[int], str]:
    """What the toy answers to `prompt` in `count` tokens: its prompt's tokens again, from the start."""
    ids = session.tokenizer.encode(prompt)
    answer = [ids[i % len(ids)] for i in range(count)]
    return answer, session.tokenizer.decode(answer)


def running(session, max_new_tokens: int = 60_000):
    """A toy job long enough to be seen running (the toy makes thousands of tokens a second), once it is."""
    stream = session.generate(PROMPT, max_new_tokens=max_new_tokens, temperature=0, stop_at_eos=False)
    deadline = time.monotonic() + 10
    while not session.jobs() and time.monotonic() < deadline:
        time.sleep(0.001)
    return stream


def test_the_toy_engine_runs_through_the_python_api(toy):
    ids, text = echo(toy, PROMPT, 7)

    result = toy.complete(PROMPT, max_new_tokens=7, temperature=0)

    assert toy.status().engine == "toy"
    assert list(result.token_ids) == ids and result.text == text
    assert result.eos_reason.value == "max_new_tokens" and result.new_tokens == 7
    assert result.time_to_first_token_s is not None and result.decode_tokens_per_s is not None


def test_the_toy_engine_honours_stop_tokens_and_strings(toy):
    ids = toy.tokenizer.encode(PROMPT)

    by_token = toy.complete(PROMPT, max_new_tokens=50, temperature=0, stop=[ids[2]], stop_at_eos=False)
    by_string = toy.complete(PROMPT, max_new_tokens=50, temperature=0, stop=["three"], stop_at_eos=False)

    assert by_token.eos_reason.value == "stop_token" and by_token.text == toy.tokenizer.decode(ids[:2])
    assert by_string.eos_reason.value == "stop_string" and by_string.text == PROMPT[: PROMPT.index("three")]


def test_the_toy_engine_refuses_what_it_cannot_do_by_name(toy):
    sampled = rf"the toy engine does not implement temperature={SamplerSettings().temperature!r}"
    with pytest.raises(ValueError, match=sampled):
        toy.complete(PROMPT, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"the toy engine does not implement top_tokens=3"):
        toy.complete(PROMPT, max_new_tokens=4, temperature=0, top_tokens=3)


def test_the_toy_engine_runs_through_the_magics(shell, toy, capsys):
    shell.run_line_magic("exl_load", "--engine toy --cache-tokens 65536")
    ids, text = echo(toy, PROMPT, 5)
    shell.run_cell_magic(
        "exl_generate", "--temperature 0 --max-new-tokens 5 --template raw --display text --out r", PROMPT
    )
    result = shell.user_ns.pop("r")

    long = running(toy)
    shell.run_line_magic("exl_jobs", "")
    shell.run_line_magic("exl_cache", "")
    shell.run_line_magic("exl_cancel", "--all")
    ended = long.result()
    out = capsys.readouterr().out

    assert "toy engine" in out and "this engine shows no cache pages" in out
    assert list(result.token_ids) == ids and result.text == text
    assert re.search(rf"\b{long.job_id}\b.*decode", out)
    assert ended.eos_reason.value == "cancelled" and 0 < ended.new_tokens < 60_000


def test_unknown_engine_at_exl_load_names_the_registered_ones(shell, toy):
    with pytest.raises(UsageError, match=r"nope.*toy"):
        shell.run_line_magic("exl_load", "--engine nope")


def test_the_toy_engine_runs_through_the_widgets(shell, toy):
    _, text = echo(toy, PROMPT, 6)
    with capture_output(stdout=False, stderr=False) as captured:
        generation = start(PROMPT, max_new_tokens=6, temperature=0, template="raw")
        view = StreamView(generation, max_new_tokens=6)
        view.show()
        generation.wait(30)
    long = running(toy)
    table, inspector = JobTable(toy, interval=0.02), CacheInspector(toy, interval=0.02)
    table.close()
    inspector.close()
    long.cancel()

    assert text in captured.outputs[-1].data["text/plain"]
    assert f'data-job="{long.job_id}"' in table.html
    assert f"job {long.job_id}" in inspector.text() and "this engine shows no cache pages" in inspector.text()


def test_the_toy_engine_s_results_are_recorded_and_published_by_its_declaration_alone(toy, tmp_path, monkeypatch):
    recorded, benchmarked = environment(toy), harness.environment()
    out = tmp_path / "reports"
    (out / "latency").mkdir(parents=True)
    (out / "latency" / "latency.json").write_text(json.dumps({"environment": recorded}))
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "results")

    target = report.publish([report.NotebookRun("latency", 1.0, {"environment": recorded})], out, None)

    assert recorded["engine"] == "toy"
    for env in (recorded, benchmarked):  # its library's version, beside the kit's own
        assert env["versions"]["tokenizers"] == metadata.version("tokenizers") and env["versions"]["torch"]
    assert target == tmp_path / "results" / "toy" and (target / "latency.json").exists()


def test_an_engine_whose_library_is_missing_is_refused_before_the_loaded_model_is_touched(toy, registered):
    registered(replace(TOY_SPEC, name="toy-elsewhere", library="exlnb_no_such_library"))
    engine = toy.engine

    with pytest.raises(
        ValueError, match="the toy-elsewhere engine runs on exlnb_no_such_library, which is not installed here"
    ):
        toy.load("smollm2-135m-instruct", engine="toy-elsewhere", progress=False)
    assert toy.engine is engine
