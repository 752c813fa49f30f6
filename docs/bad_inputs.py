"""Write docs/bad-inputs.md by running every bad input it lists: what the user sees, and whether the session
still answers afterwards. Generated, so the table cannot drift from the code; `--check` fails if it has.

    python docs/bad_inputs.py            # rewrite docs/bad-inputs.md
    python docs/bad_inputs.py --check    # exit 1 if the committed table differs from what the code does now
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a mistaken hub id is answered from here, the same everywhere

TABLE = Path(__file__).with_name("bad-inputs.md")
QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Row:
    shown: str  # the input as the user writes it
    run: Callable[[object, dict], None]  # (shell, places) -> raises or prints what the user sees
    loaded: bool = True  # run with the model loaded


def cell(line: str, body: str = QUESTION) -> Callable:
    return lambda shell, places: shell.run_cell_magic("exl_generate", line.format(**places), body)


def line(magic: str, text: str) -> Callable:
    return lambda shell, places: shell.run_line_magic(magic, text.format(**places))


def python(source: str) -> Callable:
    return lambda shell, places: exec(source, shell.user_ns)  # noqa: S102 - the rows are this file's own code


ROWS = [
    Row("%exl_jobs  (before any %exl_load)", line("exl_jobs", ""), loaded=False),
    Row("%exl_cache  (before any %exl_load)", line("exl_cache", ""), loaded=False),
    Row("%%exl_generate  (before any %exl_load)", cell(""), loaded=False),
    Row("%exl_load a/file.txt  (a file, not a folder)", line("exl_load", "{file}")),
    Row("%exl_load no_such_dir/model", line("exl_load", "no_such_dir/model")),
    Row("%exl_load folder/  (config.json is not JSON)", line("exl_load", "{garbage}")),
    Row("%exl_load folder/  (config.json and no weights)", line("exl_load", "{config_only}")),
    Row("%exl_load --cache-tokens 1000000000000", line("exl_load", "--engine cpu --cache-tokens 1000000000000")),
    Row("%exl_load --engine cpu --cache q4", line("exl_load", "--engine cpu --cache q4")),
    Row("%exl_load --engine tpu", line("exl_load", "--engine tpu")),
    Row("%exl_load --gpu-split x", line("exl_load", "--gpu-split x")),
    Row("%exl_load --cache-tokens 1024  (another model while a job runs)",
        lambda shell, places: (shell.run_cell_magic("exl_generate", "--background --max-new-tokens 200 --display text",
                                                    "Count to one hundred."),
                               shell.run_line_magic("exl_load", "--engine cpu --cache-tokens 1024"))),
    Row("%%exl_generate --temprature 0.5", cell("--temprature 0.5")),
    Row("%%exl_generate --temperature -1", cell("--temperature -1")),
    Row("%%exl_generate --tokens 50", cell("--tokens 50")),
    Row("%%exl_generate --template llama9", cell("--template llama9")),
    Row("%%exl_generate --max-new-tokens 1000000000", cell("--max-new-tokens 1000000000")),
    Row("%%exl_generate --n 10000", cell("--n 10000")),
    Row("%%exl_generate --seed 18446744073709551616", cell("--seed 18446744073709551616")),
    Row("%%exl_generate --amnesia  (no --chat)", cell("--amnesia")),
    Row("%%exl_generate --n 2 --chat tutor", cell("--n 2 --chat tutor")),
    Row('%%exl_generate --stop ""', cell('--stop ""')),
    Row("%%exl_generate with {k[0]} in the cell (no k)", cell("", "Tell me about {k[0]}.")),
    Row("%%exl_generate with {d[missing]} in the cell (d = {})", cell("", "Tell me about {d[missing]}.")),
    Row("%%exl_generate with a lone surrogate (\\ud800) in the cell", cell("", "Hello \ud800 there")),
    Row("%%exl_generate --json-schema person --regex '[0-9]+'", cell("--json-schema person --regex '[0-9]+'")),
    Row("%%exl_generate --json-schema nobody  (no such variable or file)", cell("--json-schema nobody")),
    Row('%%exl_generate --json-schema typo  (typo = {"type": "objec"})', cell("--json-schema typo")),
    Row("%%exl_generate --regex '(a'", cell("--regex '(a'")),
    Row('session.generate(p, regex="[a-z]+", banned_strings=["x"])',
        python("get_session().generate(P, regex='[a-z]+', banned_strings=['x'])")),
    Row("%exl_cancel  (no ids)", line("exl_cancel", "")),
    Row("session.generate(p, temprature=0.5)", python("get_session().generate(P, temprature=0.5)")),
    Row("session.generate(p, max_new_tokens=1.5)", python("get_session().generate(P, max_new_tokens=1.5)")),
    Row('session.generate(p, max_new_tokens="abc")', python("get_session().generate(P, max_new_tokens='abc')")),
    Row("session.generate(p, top_k=2.5)", python("get_session().generate(P, top_k=2.5)")),
    Row("session.generate(p, seed=2**64)", python("get_session().generate(P, seed=2**64)")),
    Row("generate_live(p, backgroud=True)", python("generate_live(P, backgroud=True)")),
]


def run_rows() -> list[tuple[str, str, str]]:
    from IPython.core.interactiveshell import InteractiveShell

    from exlnb import generate_live, get_session

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "exlnb")
    shell.user_ns.update(P=QUESTION, d={}, get_session=get_session, generate_live=generate_live,
                         person={"type": "object", "properties": {"name": {"type": "string"}}}, typo={"type": "objec"})
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        places = _places(Path(tmp))
        for row in ROWS:
            if row.loaded and not get_session().loaded:
                get_session().load(engine="cpu", progress=False)
            seen = _what_the_user_sees(row, shell, places, tmp)
            get_session().cancel_all()
            results.append((row.shown, seen, _still_usable(row)))
    return results


def _places(tmp: Path) -> dict[str, str]:
    file = tmp / "file.txt"
    file.write_text("not a model")
    garbage, config_only = tmp / "garbage", tmp / "config_only"
    garbage.mkdir()
    (garbage / "config.json").write_text("{not json")
    config_only.mkdir()
    (config_only / "config.json").write_text('{"model_type": "llama"}')
    return dict(file=str(file), garbage=str(garbage), config_only=str(config_only))


def _what_the_user_sees(row: Row, shell, places: dict, tmp: str) -> str:
    from IPython.core.error import UsageError

    try:
        row.run(shell, places)
    except UsageError as error:
        seen = f"UsageError: {error}"
    except Exception as error:  # noqa: BLE001 - what a Python caller gets is the point of the row
        seen = f"{type(error).__name__}: {error}"
    else:
        seen = "(no error)"
    seen = seen.replace(tmp + "/", "").replace(str(Path.cwd()) + "/", "")
    seen = re.sub(r"the [\d,.]+ GiB this machine has", "the memory this machine has (N GiB)", seen)  # per machine
    if "\n" in seen:
        seen = "TRACEBACK OR MULTI-LINE: " + seen.replace("\n", " / ")
    return seen


def _still_usable(row: Row) -> str:
    from exlnb import SamplerSettings, get_session

    session = get_session()
    if not row.loaded:
        return "yes (nothing was loaded)"
    answer = session.complete(
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n", max_new_tokens=8, sampler=SamplerSettings.greedy()
    )
    return "yes" if "Paris" in answer.text else f"NO: {answer.text!r}"


def markdown(results: list[tuple[str, str, str]]) -> str:
    lines = [
        "# Bad inputs and what exlnb says",
        "",
        "Generated by `python docs/bad_inputs.py`, which runs every row on the CPU engine with the bundled model",
        "(a test checks that this file matches the code). After each row a short greedy question is asked to show",
        "that the session still answers.",
        "",
        "| input | what the user sees | session still usable |",
        "|---|---|---|",
    ]
    cell_text = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines += [f"| `{cell_text(shown)}` | {cell_text(seen)} | {usable} |" for shown, seen, usable in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = markdown(run_rows())
    if "--check" in argv:
        if TABLE.read_text() != text:
            print(f"{TABLE} is out of date: run python docs/bad_inputs.py", file=sys.stderr)
            return 1
        return 0
    TABLE.write_text(text)
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
