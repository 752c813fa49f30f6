"""Write docs/bad-inputs.md by typing every bad input it lists into a real ipykernel: what the user sees, and
whether the session still answers afterwards. The table is generated from `CASES`, which
tests/test_bad_inputs.py replays, so the page cannot drift from the code; `--check` fails if it has. The rows
marked `server` run against tests/servers.py's stand-in OpenAI-compatible server, which sends each fault on cue.

    python docs/bad_inputs.py            # rewrite docs/bad-inputs.md
    python docs/bad_inputs.py --check    # exit 1 if the committed table differs from what the code does now
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a mistaken hub id is answered from here, the same everywhere

ROOT = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("bad-inputs.md")
QUESTION = "What is the capital of France?"
TIMEOUT_S = 300  # every wait on the kernel is bounded
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@dataclass(frozen=True)
class Case:
    """A bad input as a user types it into a notebook: a cell (after a `setup` cell where it needs one)."""

    shown: str  # the input as the table names it
    cell: str
    setup: str = ""
    loaded: bool = True  # run with the model loaded
    server: bool = False  # loaded from the stand-in server (`URL`, its address `HOST`), not on the CPU engine


def generate(options: str, body: str = QUESTION) -> str:
    return f"%%exl_generate {options}\n{body}"


GREEDY = "max_new_tokens=8, sampler=SamplerSettings.greedy()"
ANSWER = generate("--max-new-tokens 8 --temperature 0 --tokens 3 --display text --out answer")  # one to branch
# a reference kept, as exlnb keeps one, from a model whose tokenizer is not the loaded model's (Llama 3's vocabulary)
OTHER_TOKENIZER = (
    "import torch\nfrom exlnb.divergence import Reference\n"
    "torch.save(vars(Reference('llama-3-8b', 'model', 'tokenizer', tuple(range(16)), 'float32', "
    "torch.zeros(16, 128256), None)), 'llama-3-8b.pt')"
)
# a model folder like the bundled one but for one token of its tokenizer: another tokenizer, the same weights
OTHER_TOKENIZER_FOLDER = """from pathlib import Path
from exlnb.models import resolve_model
bundled, other = resolve_model('smollm2-135m-instruct'), Path('other-tokenizer')
other.mkdir(exist_ok=True)
for path in bundled.iterdir():
    if not (other / path.name).exists():
        (other / path.name).symlink_to(path)
(other / 'tokenizer.json').unlink()
(other / 'tokenizer.json').write_text((bundled / 'tokenizer.json').read_text().replace('"<|im_end|>"', '"<|x|>"'))"""
# the fields of a reference that exlnb keeps, over the loaded model's vocabulary, to damage one way per file
KEPT = (
    "import random, torch\nfrom exlnb.divergence import Reference\n"
    "kept = vars(Reference('smollm2', 'model', 'tokenizer', tuple(range(16)), 'float32', torch.zeros(16, 49152), None))"
)
# a pickle that would run code when loaded (print, here), as a file found on the internet might
PAYLOAD = "class Payload:\n    def __reduce__(self):\n        return (print, ('this file ran code',))"
BAD_REFERENCE_FILES = [
    ("random.pt", "4 KB of random bytes", "open('random.pt', 'wb').write(random.Random(0).randbytes(4096))"),
    ("evil.pt", "a pickle that would run code", f"{PAYLOAD}\ntorch.save({{**kept, 'model': Payload()}}, 'evil.pt')"),
    ("bare.pt", "a bare tensor", "torch.save(torch.zeros(16, 49152), 'bare.pt')"),
    ("extra.pt", "a reference with a key of its own", "torch.save({**kept, 'note': 'mine'}, 'extra.pt')"),
    (
        "outside.pt",
        "token ids outside the vocabulary",
        "torch.save({**kept, 'token_ids': (*range(14), -1, 60000)}, 'outside.pt')",
    ),
    (
        "nan.pt",
        "NaN logits",
        "torch.save({**kept, 'logits': torch.zeros(16, 49152).index_fill(1, torch.tensor([7]), float('nan'))}, "
        "'nan.pt')",
    ),
]


def tree_cell(options: str) -> str:
    return f"%%exl_tree {options} --max-new-tokens 4 --display text\nName a colour."


TREE = "%%exl_tree --n 2 --max-new-tokens 4 --seed 1 --display text --out tree\nName a colour."  # one to grow
PLAIN_ANSWER = generate("--max-new-tokens 4 --temperature 0 --display text --out answer")

CASES = [
    Case("%exl_jobs  (before any %exl_load)", "%exl_jobs", loaded=False),
    Case("%exl_cache  (before any %exl_load)", "%exl_cache", loaded=False),
    Case("%%exl_generate  (before any %exl_load)", generate(""), loaded=False),
    Case("%exl_load a/file.txt  (a file, not a folder)", "%exl_load file.txt"),
    Case("%exl_load no_such_dir/model", "%exl_load no_such_dir/model"),
    Case("%exl_load folder/  (config.json is not JSON)", "%exl_load garbage"),
    Case("%exl_load folder/  (config.json and no weights)", "%exl_load config_only"),
    Case("%exl_load --cache-tokens 1000000000000", "%exl_load --engine cpu --cache-tokens 1000000000000"),
    Case("%exl_load --engine cpu --cache q4", "%exl_load --engine cpu --cache q4"),
    Case("%exl_load --engine tpu", "%exl_load --engine tpu"),
    Case("%exl_load --gpu-split x", "%exl_load --gpu-split x"),
    Case(
        "%exl_load --cache-tokens 1024  (another model while a job runs)",
        "%exl_load --engine cpu --cache-tokens 1024",
        setup=generate("--background --max-new-tokens 200 --display text", "Count to one hundred."),
    ),
    Case("session.load(max_batch_size=1.5)", "get_session().load(engine='cpu', max_batch_size=1.5)"),
    Case("session.load(cache_tokens=1000.5)", "get_session().load(engine='cpu', cache_tokens=1000.5)"),
    Case("%exl_quantize /etc/passwd", "%exl_quantize /etc/passwd"),
    Case("%%exl_generate --temprature 0.5", generate("--temprature 0.5")),
    Case("%%exl_generate --temperature -1", generate("--temperature -1")),
    Case("%%exl_generate --tokens 50", generate("--tokens 50")),
    Case("%%exl_generate --template llama9", generate("--template llama9")),
    Case("%%exl_generate --max-new-tokens 1000000000", generate("--max-new-tokens 1000000000")),
    Case("%%exl_generate --n 10000", generate("--n 10000")),
    Case("%%exl_generate --seed 18446744073709551616", generate("--seed 18446744073709551616")),
    Case("%%exl_generate --amnesia  (no --chat)", generate("--amnesia")),
    Case("%%exl_generate --n 2 --chat tutor", generate("--n 2 --chat tutor")),
    Case('%%exl_generate --stop ""', generate('--stop ""')),
    Case("%%exl_generate --out 1abc", generate("--out 1abc")),
    Case("%%exl_generate with an empty cell", generate("", "")),
    Case("%%exl_generate with only spaces and newlines in the cell", generate("", "   \n\t\n  ")),
    Case("%%exl_generate with {k[0]} in the cell (no k)", generate("", "Tell me about {k[0]}.")),
    Case("%%exl_generate with {d[missing]} in the cell (d = {})", generate("", "Tell me about {d[missing]}.")),
    Case("%%exl_generate with {k[0]} in the cell (k = 5)", generate("", "Tell me about {k[0]}."), setup="k = 5"),
    Case(
        "%%exl_generate with {s} in the cell (s holds a lone surrogate, \\ud800)",
        generate("", "{s}"),
        setup="s = 'Hello \\ud800 there'",
    ),
    Case("%%exl_generate --json-schema person --regex '[0-9]+'", generate("--json-schema person --regex '[0-9]+'")),
    Case("%%exl_generate --json-schema nobody  (no such variable or file)", generate("--json-schema nobody")),
    Case('%%exl_generate --json-schema typo  (typo = {"type": "objec"})', generate("--json-schema typo")),
    Case(
        'session.complete(p, json_schema=refs)  (refs uses "$ref")',
        f"print(repr(get_session().complete(Q, json_schema=refs, {GREEDY}).text))",
    ),
    Case("%%exl_generate --regex '(a'", generate("--regex '(a'")),
    Case(
        'session.generate(p, regex="[a-z]+", banned_strings=["x"])',
        "get_session().generate(P, regex='[a-z]+', banned_strings=['x'])",
    ),
    Case("%exl_cancel  (no ids)", "%exl_cancel"),
    Case("session.generate(p, temprature=0.5)", "get_session().generate(P, temprature=0.5)"),
    Case("session.generate(p, max_new_tokens=1.5)", "get_session().generate(P, max_new_tokens=1.5)"),
    Case('session.generate(p, max_new_tokens="abc")', "get_session().generate(P, max_new_tokens='abc')"),
    Case("session.generate(p, top_k=2.5)", "get_session().generate(P, top_k=2.5)"),
    Case("session.generate(p, seed=2**64)", "get_session().generate(P, seed=2**64)"),
    Case("session.generate(p, top_a=inf)", "get_session().generate(P, top_a=float('inf'))"),
    Case("session.generate(p, temp_exponent=inf)", "get_session().generate(P, temp_exponent=float('inf'))"),
    Case("session.generate(p, rep_decay=10**20)", "get_session().generate(P, rep_decay=10**20)"),
    Case("session.generate(p, freq_penalty=nan)", "get_session().generate(P, freq_penalty=float('nan'))"),
    Case("session.generate(p, presence_penalty=nan)", "get_session().generate(P, presence_penalty=float('nan'))"),
    Case(
        'session.complete(p, stop="Paris")  (one stop string, not five letters)',
        f"print(repr(get_session().complete(Q, stop='Paris', {GREEDY}).text))",
    ),
    Case(
        'session.complete(p, banned_strings="abc")  (one string, not three letters)',
        f"print(repr(get_session().complete(Q, banned_strings='abc', {GREEDY}).text))",
    ),
    *(
        Case(f"session.generate(p, {given})", f"get_session().generate(P, {given})")
        for given in (
            "stop=[1.5]",
            "stop=[None]",
            "stop=[-1]",
            "stop=[10**9]",
            "stop=''",
            "stop=None",
            "sampler='greedy'",
            "token_bias='x'",
            "stop_on_loop=(1,)",
        )
    ),
    *(
        Case(f"session.generate({given})", f"get_session().generate({given})")
        for given in ("b'What is the capital of France?'", "None", "123")
    ),
    Case("session.generate(a 50 MB prompt)", "get_session().generate('x' * 50_000_000)"),
    Case("session.generate(a 1 MB prompt)", "get_session().generate('x' * 1_000_000)"),
    Case("session.generate(10**7 token ids)", "get_session().generate([1] * 10**7)"),
    Case("session.load(gpu_split=20)", "get_session().load(engine='cpu', gpu_split=20)"),
    Case("generate_live(p, backgroud=True)", "generate_live(P, backgroud=True)"),
    Case("%exl_branch answer --at 99  (past the answer's end)", "%exl_branch answer --at 99", setup=ANSWER),
    Case(
        "%exl_branch answer --at 2 --token-id 99999999", "%exl_branch answer --at 2 --token-id 99999999", setup=ANSWER
    ),
    *(
        Case(f"answer.branch(at={at})", f"answer.branch(at={at})", setup=ANSWER)
        for at in ("True", "1.5", "'3'", "None")
    ),
    Case("answer.branch(at=2, token='\\ud800')", "answer.branch(at=2, token='\\ud800')", setup=ANSWER),
    Case(
        "answer.branch(at=2)  (the model loaded again with another cache size)",
        "%exl_load --engine cpu --cache-tokens 4096\nanswer.branch(at=2)",
        setup=ANSWER,
    ),
    Case("%exl_branch answer --at 2 --out 1abc", "%exl_branch answer --at 2 --out 1abc", setup=ANSWER),
    Case("%exl_branch answer --at 2 --out class", "%exl_branch answer --at 2 --out class", setup=ANSWER),
    Case(
        "%exl_divergence llama-3-8b.pt  (a reference kept from a model with another tokenizer)",
        "%exl_divergence llama-3-8b.pt",
        setup=OTHER_TOKENIZER,
    ),
    Case(
        "%exl_divergence other-tokenizer  (a model folder with another tokenizer)",
        "%exl_divergence other-tokenizer",
        setup=OTHER_TOKENIZER_FOLDER,
    ),
    Case(
        "%exl_divergence smollm2-135m-instruct --tokens 1000000000",
        "%exl_divergence smollm2-135m-instruct --tokens 1000000000",
    ),
    Case(
        "%exl_divergence smollm2-135m-instruct --tokens 9000  (the cache holds 8192)",
        "%exl_divergence smollm2-135m-instruct --tokens 9000",
    ),
    Case("%exl_divergence smollm2-135m-instruct --out 1abc", "%exl_divergence smollm2-135m-instruct --out 1abc"),
    *(
        Case(f"%exl_divergence {name}  ({what})", f"%exl_divergence {name}", setup=f"{KEPT}\n{write}")
        for name, what, write in BAD_REFERENCE_FILES
    ),
    Case("%exl_bench --seed -1", "%exl_bench --seed -1 --no-progress"),
    Case("%%exl_tree --n 0", tree_cell("--n 0")),
    Case("%%exl_tree --n 10000", tree_cell("--n 10000")),
    Case("%%exl_tree --mass 2", tree_cell("--mass 2")),
    Case("tree.expand(99999)  (a node that is not in the tree)", "tree.expand(99999)", setup=TREE),
    Case(
        "tree.force(0, ' and' * 40)  (more tokens than the answer has left)", "tree.force(0, ' and' * 40)", setup=TREE
    ),
    Case(
        "%%exl_tree --reference llama-3-8b.pt  (a reference with another vocabulary)",
        tree_cell("--reference llama-3-8b.pt"),
        setup=OTHER_TOKENIZER,
    ),
    Case("answer.near_ties()  (an answer generated without --tokens)", "answer.near_ties()", setup=PLAIN_ANSWER),
    Case("exlnb.bench(request_rate=1e-6)", "exlnb.bench(1e-6)"),
    *(
        Case(f"%%exl_generate  (the server sends {sent})", generate("--display text", f"shape:{fault}"), server=True)
        for fault, sent in [
            ("choices-text", '"choices": "abc"'),
            ("choice-number", '"choices": [5]'),
            ("content-number", '"content": 42'),
            ("usage-words", '"completion_tokens": "lots"'),
            ("finish-list", '"finish_reason": ["stop"]'),
            ("logprob-text", '"logprob": "abc"'),
        ]
    ),
    *(
        Case(
            f"%%exl_generate --max-new-tokens 4  (the server {does})",
            generate("--max-new-tokens 4 --display text", fault),
            server=True,
        )
        for fault, does in [
            ("cut", "cuts its close-delimited body mid-answer"),
            ("no-choices", "answers 200 with no choices"),
            ("no-finish", "sends [DONE] and no finish_reason"),
            ("endless", "keeps streaming"),
            ("big-event", "sends a 2 MiB event"),
            ("long-line", "sends a 200 MB line without a newline"),
            ("big-error", "answers 500 with a 200 MB body"),
            ("chatter", "sends frames with no token and no end"),
        ]
    ),
    Case("%exl_load --url http://user:KEY@127.0.0.1:PORT/v1", "%exl_load --url http://user:KEY@{HOST}/v1", server=True),
    Case("%exl_load --url http://127.0.0.1:PORT/v1?key=KEY", "%exl_load --url http://{HOST}/v1?key=KEY", server=True),
    Case(
        "%exl_load --url ...  (the server says max_model_len is -5)",
        "%exl_load --url http://{HOST}/len-5/v1 --api-key-env EXLNB_FAKE_KEY",
        server=True,
    ),
    Case(
        "%exl_load --url ...  (the server answers 307)",
        "%exl_load --url http://{HOST}/moved/v1 --api-key-env EXLNB_FAKE_KEY",
        server=True,
    ),
    Case(
        "%exl_load --url ...  (the server lists no model, as transformers serve before 5.24 does)",
        "%exl_load --url http://{HOST}/unlisted/v1 --api-key-env EXLNB_FAKE_KEY",
        server=True,
    ),
    Case("%exl_load --url ... --dialect ollama", "%exl_load --url http://{HOST}/v1 --dialect ollama", server=True),
]

# the names the cases use, defined in the kernel before the first case
PRELUDE = f"""
%load_ext exlnb
import exlnb
from exlnb import SamplerSettings, generate_live, get_session
P = {QUESTION!r}
Q = "<|im_start|>user\\n" + P + "<|im_end|>\\n<|im_start|>assistant\\n"
d = {{}}
person = {{"type": "object", "properties": {{"name": {{"type": "string"}}}}}}
typo = {{"type": "objec"}}
refs = {{"$defs": {{"name": {{"type": "string"}}}}, "type": "object",
        "properties": {{"name": {{"$ref": "#/$defs/name"}}}}}}
"""


@dataclass
class Reply:
    """A cell's outputs as the kernel sent them."""

    stdout: str = ""
    stderr: str = ""
    error: dict | None = None
    widget_html: str = ""  # a widget's last drawing (comm updates of its `html`)
    record: str = ""  # the plain text of the static record a widget leaves
    widgets: int = 0  # outputs that show a widget

    def seen(self) -> str:
        """What the user sees: the error (a magic's UsageError is printed, not raised to the front end), else
        what the cell printed."""
        if self.error is not None:
            return f"{self.error['ename']}: {self.error['evalue']}"
        usage = self.stderr[self.stderr.find("UsageError:") :] if "UsageError:" in self.stderr else ""
        return (usage or self.stdout).strip() or "(no error)"


class Kernel:
    """A real ipykernel started without a Jupyter server (as papermill and nbclient start one), run cell by cell."""

    def __init__(self, cwd: str | None = None, env: dict[str, str] | None = None) -> None:
        import jupyter_client

        env = {k: v for k, v in os.environ.items() if k != "JPY_SESSION_NAME"} | (env or {})
        self.manager, self.client = jupyter_client.manager.start_new_kernel(
            kernel_name="python3", startup_timeout=120, env=env, cwd=cwd or str(ROOT)
        )

    def execute(self, code: str, *, interrupt_when=None) -> Reply:
        """Run `code`; with `interrupt_when(reply)`, interrupt the kernel (SIGINT, as JupyterLab does) the
        first time it holds."""
        msg_id = self.client.execute(code, store_history=False)
        reply, interrupted = Reply(), False
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            msg = self.client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                return reply
            if kind == "stream":
                setattr(reply, content["name"], getattr(reply, content["name"]) + content["text"])
            elif kind == "error":
                reply.error = content
            elif kind in ("comm_open", "comm_msg"):
                reply.widget_html = content.get("data", {}).get("state", {}).get("html", reply.widget_html)
            elif kind in ("display_data", "update_display_data"):
                reply.widgets += WIDGET_MIME in content["data"]
                if kind == "update_display_data":
                    reply.record = content["data"].get("text/plain", reply.record)
            if interrupt_when is not None and not interrupted and interrupt_when(reply):
                self.manager.interrupt_kernel()
                interrupted = True

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def run_cases(cases: list[Case] = CASES) -> list[tuple[str, str, str]]:
    """(input, what the user sees, whether the session still answers) for each case, in one kernel."""
    with tempfile.TemporaryDirectory() as tmp, _stand_in_server() as server:
        _make_places(Path(tmp))
        kernel = Kernel(cwd=tmp, env={"EXLNB_FAKE_KEY": server.key})
        try:
            _expect_no_error(kernel.execute(f"{PRELUDE}\nURL = {server.url!r}\nHOST = URL[len('http://'):-len('/v1')]"))
            return [(case.shown, _clean(run_case(kernel, case), tmp), _still_usable(kernel, case)) for case in cases]
        finally:
            kernel.close()


def _stand_in_server():
    """tests/servers.py's stand-in server, answering in this process while the kernel talks to it."""
    if str(ROOT) not in sys.path:  # run as `python docs/bad_inputs.py`
        sys.path.insert(0, str(ROOT))
    from tests.servers import running_fake_server

    return running_fake_server()


def run_case(kernel: Kernel, case: Case) -> str:
    if case.server:
        _expect_no_error(kernel.execute("get_session().load(url=URL, api_key_env='EXLNB_FAKE_KEY', progress=False)"))
    elif case.loaded:
        _expect_no_error(kernel.execute("get_session().load(engine='cpu', progress=False)"))
    if case.setup:
        _expect_no_error(kernel.execute(case.setup))
    seen = kernel.execute(case.cell).seen()
    _expect_no_error(kernel.execute("get_session().cancel_all() if get_session().loaded else None"))
    return seen


def _still_usable(kernel: Kernel, case: Case) -> str:
    if not case.loaded:
        return "yes (nothing was loaded)"
    question, answer = ("'still here'", "Hello still here") if case.server else ("Q", "Paris")
    seen = kernel.execute(f"print(get_session().complete({question}, {GREEDY}).text)").seen()
    return "yes" if answer in seen else f"NO: {seen!r}"


def _make_places(tmp: Path) -> None:
    (tmp / "file.txt").write_text("not a model")
    (tmp / "garbage").mkdir()
    (tmp / "garbage" / "config.json").write_text("{not json")
    (tmp / "config_only").mkdir()
    (tmp / "config_only" / "config.json").write_text('{"model_type": "llama"}')


def _clean(seen: str, tmp: str) -> str:
    """The same words on every machine: no temporary folder, no checkout path, no memory size."""
    for folder in {tmp, str(Path(tmp).resolve()), str(ROOT)}:
        seen = seen.replace(folder + "/", "")
    seen = re.sub(r"the [\d,.]+ GiB this machine has", "the memory this machine has (N GiB)", seen)
    seen = re.sub(r"\x1b\[[0-9;]*m", "", seen)  # colours of a traceback
    seen = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", seen)  # the stand-in server's free port
    if "\n" in seen:
        seen = "TRACEBACK OR MULTI-LINE: " + seen.replace("\n", " / ")
    return seen


def _expect_no_error(reply: Reply) -> None:
    if reply.error is not None:
        raise RuntimeError(f"a step between the cases failed: {reply.seen()}")


def markdown(results: list[tuple[str, str, str]]) -> str:
    lines = [
        "# Bad inputs and what exlnb says",
        "",
        "Generated by `python docs/bad_inputs.py`, which types every row into a real ipykernel with the bundled",
        "model on the CPU engine (tests/test_bad_inputs.py replays the same rows and fails when this page is out of",
        "date). After each row a short greedy question is asked to show that the session still answers. The rows",
        "about a server run against tests/servers.py's stand-in OpenAI-compatible server, which sends each fault on",
        "cue (its port shown as PORT); the question then goes to that server.",
        "",
        "| input | what the user sees | session still usable |",
        "|---|---|---|",
    ]

    def cell_text(text: str) -> str:
        return text.replace("|", "\\|")

    lines += [f"| `{cell_text(shown)}` | {cell_text(seen)} | {usable} |" for shown, seen, usable in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = markdown(run_cases())
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
