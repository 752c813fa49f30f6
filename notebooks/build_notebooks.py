"""Writes the investigation notebooks from the cell sources below: `python notebooks/build_notebooks.py`.

The notebooks are thin on purpose: a parameters cell (tagged for papermill), a call into `exlnb.experiments`,
a figure, and the saved results. Edit them here, not in Jupyter, so that they stay alike. The parameters
and their defaults (small enough for CI on the CPU engine) come from each experiment's `run()` signature
through `exlnb.experiments.notebooks`; only their comments are written here.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from exlnb.experiments.notebooks import check_parameters, notebook_parameters, run_parameters

HERE = Path(__file__).parent
COMMENT_COLUMN = 28
# what every notebook's first parameters mean (the report passes engine and output_dir to each notebook)
SESSION_NOTES = {
    "engine": '"auto": ExLlamaV2 where CUDA is available, else the CPU engine',
    "output_dir": "the CSVs, the JSON summary and the PNG figure go here",
}


@dataclass(frozen=True)
class Investigation:
    name: str  # notebook file and exlnb.experiments module
    title: str
    story: str  # the field report in brief, and how this notebook reproduces it
    notes: dict[str, str]  # a comment for some of the experiment's parameters (the rest speak for themselves)
    inspect_text: str = ""  # an optional closing section: what it shows (markdown) ...
    inspect_code: str = ""  # ... and its code
    inspect_leaves_jobs: bool = False  # a last cell then cancels the jobs the closing section leaves running


INVESTIGATIONS = (
    Investigation(
        name="latency",
        title="Latency that grows from seconds to minutes (field report 1)",
        story="""\
A service answers requests one after another. Each consumer reads a few tokens and leaves on its own stop
condition. The reporter's code left with `break` and never cancelled the job, so every job ran on to
`max_new_tokens` with nobody reading: it kept its cache pages and its batch slot, and later requests queued
behind it (5 s per request at first, up to 5 minutes after about 100 requests).

`generate(..., cancel_when_abandoned=False)` restores that bug on purpose; exlnb's default cancels the job
when its consumer leaves. The cache is small on purpose (4 pages of 256 tokens, one per request): the ratio
of cache to request size decides how many abandoned jobs fit before new requests must wait.

The reporter ran a 7B model. Where a GPU has room for it, the same requests also run on a Llama-2-7B-shaped
model with random weights, written on the GPU for this run, with a cache of as many pages: its text is
meaningless, its timings are a 7B model's.""",
        notes={
            "cache_tokens": "4 pages of 256 tokens, one per request",
            "requests": "requests sent one after another: a multiple of the cache's 4 pages, so that without the "
            "cancel the next job finds every page held by an abandoned job",
            "tokens_read": "tokens each consumer reads before it leaves",
            "max_new_tokens": "what each request asks for (an abandoned job runs on to this)",
            "next_job_tokens": "the normal request measured afterwards, read to the end",
            "trials": "repeats of the whole sequence per condition, for the intervals",
            "sample_interval_s": "how often the job table and cache are sampled",
            "models": '"bundled": the model loaded here; "7b-shaped": random fp16 weights written on the GPU for '
            "this run, with as many cache pages (left out, with a line saying why, where the GPU has no room for it)",
        },
        inspect_text="""\
## The cache inspector with abandoned jobs

As many requests as the cache has pages, once more without the cancel, stopped while their jobs still run
(one more would have to wait for a page): the job table and the
cache inspector (a live widget in JupyterLab, text here) show which job holds which page. On the ExLlamaV2
engine these are exllamav2's own pages.""",
        inspect_code="""\
from exlnb import show_cache, show_jobs

pages = session.cache_view().total_pages
experiment.abandon(session, requests=pages, tokens_read=tokens_read, max_new_tokens=max_new_tokens)
show_jobs()
show_cache()
""",
        inspect_leaves_jobs=True,
    ),
    Investigation(
        name="repetition",
        title="Repetition loops and sampler penalties (field reports 1 and 4)",
        story="""\
Small models fall into loops and then run to `max_new_tokens`, which is cause B of field report 1's slow
service. The report suggests `token_repetition_penalty = 1.11` and `token_frequency_penalty = 0.03`
instead of what it calls exllamav2's default of 1.05. Prompts that invite loops run over a grid of
repetition penalty x frequency penalty x temperature (greedy, and report 4's 0.7 / top-k 50 / top-p 0.8).
A loop is a tail whose 4-grams mostly occurred earlier (`exlnb.analysis.find_tail_loop`).

The same prompts, seeds and temperatures also run under named remedies (`exlnb.experiments.remedies`):
exllamav2's default penalty (1.025), the report's suggestion, DRY (multiplier 0.8, base 1.75, allowed length
2, as DRY's author recommends), XTC (probability 0.5, threshold 0.1; it acts only when sampling, so only at
temperature 0.7) and ExLlamaV3's loop detector (`stop_on_loop=(64, 3)`, which ends a looping job rather than
pulling it out: it saves the tokens the job would have run to `max_new_tokens`). Each is paired with no
penalty on the same prompt and seed. The ExLlamaV2 engine has no loop detector, so there it is left out.""",
        notes={
            "prompts": "prompts from data/prompts/loop_inviting.json",
            "samples_per_prompt": "draws per prompt at temperatures above 0 (greedy needs one)",
        },
    ),
    Investigation(
        name="prompt_format",
        title="Prompt format mistakes (field report 4)",
        story="""\
Inconsistent answers came from a wrongly applied ChatML template. The question set
(`data/questions/short_answers.csv`, 405 questions with known short answers) goes through the correct
template and through one variant per mistake the report lists: missing tags, newlines in the wrong place,
special tokens encoded as plain text, and no template (the turns' bare text). The variants are
`exlnb.templates.CHATML_VARIANTS`, the ones the template linter knows. All greedy. Each variant's accuracy
is compared with ChatML's question by question; the summary says whether the intervals of these differences
allow the formats to be ranked (with 36 questions the order of the broken variants changed with the set).""",
        notes={"questions": "the first 36, for CI; None: all 405 (--preset full), 26 minutes on two busy CPU cores"},
    ),
    Investigation(
        name="concurrency",
        title="Concurrent requests mixing each other's context (field report 2)",
        story="""\
The reporter created a generator per request, all over one model cache; simultaneous requests returned
blends of each other's prompts. The fix is one generator per model and one job per request. Both run here
on the loaded engine; the broken pattern is built from the engine's own model and cache (separate
`ExLlamaV2DynamicGenerator`s on the ExLlamaV2 engine; engine copies with their own page tables on the CPU
engine). Every output is compared with the same prompt's output run alone (greedy).""",
        notes={
            "prompts": "prompts from data/prompts/long_answers.json",
            "concurrency": "requests running at the same time",
        },
    ),
    Investigation(
        name="streaming",
        title="Streaming that stalls, then bursts (field report 3)",
        story="""\
Streamed to an HTTP client, the first half of the text arrived slowly and the rest at once. A real tornado
server streams one job to a real client over a local socket, fed three ways: the reporter's nested async
iteration with the generator on the event loop, the collector queue the report proposes (TabbyAPI's), and
the exlnb session (the engine on its own thread, results through a queue). The handler makes a chosen number
of event-loop passes per chunk, as anyio-based web stacks do on every send.""",
        notes={
            "checkpoints": "event-loop passes the web handler makes per chunk",
            "symptom_checkpoints": "the case shown in the timeline and the summary",
        },
    ),
    Investigation(
        name="context",
        title="Speed against context, and the impossible prompt speed (field reports 4 and 5)",
        story="""\
Report 4: a chat that keeps every earlier turn slows from 40 to about 10 tokens/s. Report 5: 31 tokens/s
with a short prompt, 20 with about 1000 tokens, and a prompt speed of 14,982 tokens/s that was a clock read
before the GPU had done the work. Measured here: decode speed per chat turn with history against amnesia,
decode speed against context length, and prompt speed from a clock read when the call returns against one
read after synchronising.

The reporter timed exllamav2's streaming generator, `ExLlamaV2StreamingGenerator.begin_stream_ex` (exllamav2's
`examples/streaming.py`). Its prompt pass calls `model.forward(..., preprocess_only=True)`, which returns no
logits and so need not wait for the GPU. That call is timed here as the reporter timed it, on the engine's own
model and cache, and beside it the dynamic generator as exlnb's engine steps it (a job, `iterate()` until its
first token). Each on the bundled model and on a Llama-2-7B-shaped model, whose heavier GPU work per token
gives the early clock the most to miss: its weights are random, written on the GPU for this run, so its text is
meaningless but its timings are real. Only the ExLlamaV2 engine on CUDA has these passes; elsewhere the notebook says so in a
line and carries on. The chat and the context lengths are timed on the 7B-shaped model too, the reporters'
model size, where a GPU has room for it.""",
        notes={
            "prompt_lengths": "report 5's prompt passes; 1441 is the reporter's length; each must fit the cache",
            "timing_repeats": "rounds of the context lengths (order rotated); timed passes per model, pass and length",
            "prompt_models": '"bundled": the model loaded here; "7b-shaped": random fp16 weights written on the GPU '
            "for this run (left out, with a line saying why, where the GPU has no room for it)",
            "speed_models": "the models the chat and context-length decode timings run on, named as in prompt_models "
            "(the 7B-shaped one times the context lengths its 4096 positions hold)",
        },
        inspect_text="""\
## Report 5 through the reporter's own path

The early clock reading (when the call returns) beside the synchronised one (after `torch.cuda.synchronize()`),
medians of the repeats, for each model, pass and prompt length; `early_over_late` is how many times faster
the early clock makes the prompt pass look than it ran.""",
        inspect_code="""\
clock_medians, not_timed = experiment.prompt_clock_medians(result)
print(*not_timed, sep="\\n")
display(clock_medians)
""",
    ),
    Investigation(
        name="quantization",
        title="What quantizing costs and buys: EXL2 and EXL3 against fp16 (GPU only)",
        story="""\
People load quantized models at 2.5 to 8 bits per weight: EXL2 with ExLlamaV2, EXL3 with ExLlamaV3. The
bundled model is quantized with each library's own converter (`exlnb.quantize.quantize`, cached after the
first run) at several bit widths and compared with fp16: greedy agreement with fp16, accuracy on the
question set (`data/questions/short_answers.csv`), perplexity on a fixed text and, on that text, the KL
divergence from fp16's next-token distributions and top-1 agreement (`exlnb.divergence`), decode speed and
memory. Quantizing needs CUDA: on a machine without it the notebook says so and stops.""",
        notes={
            "bits": "bits per weight for each format",
            "perplexity_tokens": "tokens of the fixed text scored for perplexity and KL divergence",
            "decode_tokens": "tokens generated per timed decode",
        },
    ),
    Investigation(
        name="disconnect",
        title="Does the server stop when the client leaves? (field report 1, at a server)",
        story="""\
Field report 1's abandoned jobs, at a server: published 2026 issues show SGLang, vLLM, llama.cpp's server and
TabbyAPI generating on for clients that had gone. Requests are opened and abandoned while queued, during prefill
and during decode, twice over: as streams, left by closing the connection, and as non-streaming requests, left
by the client's read timeout at the same moment. Closing the connection is all a server is ever told.

Three signals say whether the server went on working for nobody: a probe request's time to first token against
the idle server's (a server that batches answers it at once while it runs on, so the probe alone can miss it),
the server's own count of running requests where it has a Prometheus `/metrics`, and the server process's CPU
time where it runs on this machine and its PID is given. The server-side signals are read once a delayed abort
(SGLang's comes about 2 s after the client leaves) has had its time. A row says "stopped" only where every
signal it could read agrees, and names each one it could not.

The engine loaded here is the control: exlnb's session cancels an abandoned job at once (it has no connection
to lose, so it runs the streaming phases only). Give `url` (an OpenAI-compatible server's API base, serving the
same model) to measure that server beside it, and `server_mode` to record how it was started.""",
        notes={
            "url": "an OpenAI-compatible server's API base, e.g. http://127.0.0.1:8000/v1; None: the control alone",
            "served_model": "the server's name for the model; None: the one it serves",
            "dialect": 'the server\'s kind where its /v1/models does not say, e.g. "transformers"; None: read from it',
            "api_key_env": "environment variable holding the server's API key, if it wants one",
            "server_pid": "the server's process id where it runs on this machine: its CPU time is read from /proc; "
            "None: that signal is not available, and each row says so",
            "server_mode": 'how the server was started, recorded with each row, e.g. "transformers serve '
            '--continuous-batching"',
            "abandoned": "requests opened and abandoned in each phase",
            "prefill_prompt_tokens": "the prefill phase's long prompt, left half-way through its idle prefill",
            "max_new_tokens": "what each abandoned request asks for (a server that goes on runs to this)",
            "tokens_read": "tokens read before leaving in the decode phase",
            "probes": "probes on the idle target, for its reference time to first token",
            "settle_timeout_s": "how long probes, and the watch on the server's CPU, wait for it to be idle again",
        },
    ),
    Investigation(
        name="near_ties",
        title="Why greedy runs part",
        story="""\
Greedy decoding takes the argmax, so one would expect it to give the same answer every time. Users keep finding
otherwise: the answer changes between runs, batch sizes or GPUs (exllamav3 issue 353; vLLM's batch-invariance
threads), and exlnb's own tensor-parallel run parted from one card's at the first token. Where the two likeliest
tokens are nearly tied, any change of rounding can swap them. The near-tie map reads the margin (the top logit
minus the runner-up's) at every position and marks as likely to flip the positions whose margin is at or under
this engine's noise floor: how far the same steps' margins moved when run alone against inside a batch of 2, 8
and 16, against a whole-sequence pass, and, where the engine and machine have them, with a quantized cache,
without CUDA graphs, split over two GPUs (`exlnb.noise_floor`, measured on a few calibration questions).

Here questions are answered greedily in batches of 16, their flip positions predicted, and the same questions
answered again alone, in batches of 2 and 8 and in every other layout this machine can load. At every position
up to an answer's first parting, the prediction meets the outcome: how many predicted positions flipped, and how
many flips came where none was predicted. Where the engine injects noise (the CPU engine), each step is also
replayed with one bf16 rounding of noise after every layer, a simulated other kernel, calibrated the same way.""",
        notes={
            "answers": "questions answered greedily (after the calibration ones)",
            "calibration": "questions the noise floor is measured on",
            "questions_from": "the first question answered (data/questions/short_answers.csv, 0-based)",
            "baseline_batch": "the batch the answers are first run in, and their margins read from",
            "rerun_batches": "the batches they run in again (1: alone)",
            "layouts": "also run again in every other layout this engine and machine can load, each in a session "
            "of its own (a q8 cache, eager decode, a layer split, tensor parallelism)",
            "noise_replay": "replay every step with bf16-rounding noise where the engine injects it (CPU): simulated",
        },
    ),
)


def run_call(investigation: Investigation) -> str:
    arguments = "".join(f"    {name}={name},\n" for name in run_parameters(investigation.name))
    return f"result = experiment.run(\n    session,\n{arguments})"


def parameters_source(investigation: Investigation) -> str:
    """One assignment per notebook parameter, its default from the experiment, its comment from here."""
    notes = SESSION_NOTES | investigation.notes
    check_parameters(investigation.name, investigation.notes)
    lines = []
    for name, default in notebook_parameters(investigation.name).items():
        assignment = f"{name} = {json.dumps(default) if isinstance(default, str) else repr(default)}"
        comment = textwrap.wrap(notes.get(name, ""), 110 - COMMENT_COLUMN)
        lines += [f"{assignment:<{COMMENT_COLUMN - 1}} # {comment[0]}" if comment else assignment]
        lines += [f"{'':<{COMMENT_COLUMN - 1}} # {more}" for more in comment[1:]]
    return "\n".join(lines)


def build(investigation: Investigation) -> nbformat.NotebookNode:
    parameters = new_code_cell(parameters_source(investigation))
    parameters.metadata["tags"] = ["parameters"]
    cells = [
        new_markdown_cell(f"# {investigation.title}\n\n{investigation.story}"),
        parameters,
        new_code_cell(
            f"""\
from IPython.display import Markdown, display

from exlnb import get_session
import exlnb.experiments.{investigation.name} as experiment

session = get_session()
print(session.load(engine=engine, cache_tokens=cache_tokens, progress=False).line())"""
        ),
        new_markdown_cell("## The symptom, then the fix"),
        new_code_cell(
            f"""\
{run_call(investigation)}
for name, table in result.tables.items():
    display(Markdown(f"**{{name}}**: {{len(table)}} rows"), table.head())"""
        ),
        new_code_cell(
            "figure = experiment.plot(result)  # None where nothing measured could be drawn: the findings say why"
        ),
        new_markdown_cell("## What the data say"),
        new_code_cell("display(Markdown(result.markdown()))"),
        new_code_cell("for path in result.save(output_dir, figure):\n    print(path)"),
    ]
    if investigation.inspect_code:
        cells += [new_markdown_cell(investigation.inspect_text), new_code_cell(investigation.inspect_code)]
    if investigation.inspect_leaves_jobs:
        cells.append(new_code_cell('print(session.cancel_all(), "jobs cancelled")'))
    for number, cell in enumerate(cells):
        cell.id = f"{investigation.name}-{number}"  # stable ids: rebuilding changes nothing that did not change
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


def main() -> None:
    for investigation in INVESTIGATIONS:
        path = HERE / f"{investigation.name}.ipynb"
        nbformat.write(build(investigation), path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
