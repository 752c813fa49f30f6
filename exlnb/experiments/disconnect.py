"""Does the server stop when the client leaves? (field report 1's abandoned jobs, at a server)

Published 2026 issues show servers generating on for clients that have gone: SGLang (#36876, 182 abandoned
requests on one pod), vLLM (#54947), llama.cpp's server (#24496), TabbyAPI (#428). Here requests are opened and
abandoned in three phases: at once (the request still queued or just admitted), during prefill (a long prompt,
left half-way through the time its first token takes when the server is idle) and during decode (left after
`tokens_read` tokens). Each phase runs twice against a server: with streams, left by closing the connection,
and with non-streaming requests (`whole_answers.py`), left by the client's read timeout at the same moment.
Closing the connection is all a server is ever told.

Three signals say whether the server went on working for nobody, each where it is available:
- the probe: a short request right after leaving, its time to first token against the idle server's. A
  server that batches (`transformers serve --continuous-batching`) answers it at once while it runs on, so
  the probe alone can read "stopped" for a server at full CPU;
- the server's `/metrics` count of running requests, read once the wait for a delayed abort is over;
- the server process's CPU time (`server_cpu.py`) from the client leaving until it is quiet again, less what
  the probes cost it when idle: only where the server runs on this machine and `server_pid` names it.
A row's verdict (`disconnect_signals.py`) is "stopped" only where every available signal agrees, "kept working
(...)" where any one saw work for nobody, naming what it saw. The mode the server was started in (`server_mode`)
goes with each row.

exlnb's own engine, loaded in the notebook, is the control: its session cancels an abandoned job at once. A job
in the kernel has no connection to lose, so the control runs the streaming phases only.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from tqdm import tqdm  # plain text: the notebook keeps it as text

from exlnb.analysis import median_interval, ratio_of_medians
from exlnb.datasets import filler_ids
from exlnb.engines.base import SamplerSettings, wall_clock
from exlnb.engines.job_options import JobOptions
from exlnb.engines.registry import engine_spec
from exlnb.experiments import whole_answers
from exlnb.experiments.disconnect_signals import ABORT_WAIT_S, CPU_WORK_S, RECOVERED, finding, verdict
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.experiments.server_cpu import ServerCpu
from exlnb.session import Session
from exlnb.streaming import JobError

PHASES = ("queued", "prefill", "decode")
REQUESTS = ("streaming", "non-streaming")
SETTLE_PAUSE_S = 1.0  # between probes while the server settles: probes sent back to back kept a busy server busier,
# and each one's idle CPU cost is taken off the CPU for nobody (44 of them, 14 s, in one continuous-batching row)
WARM_UPS = 2  # probes before the idle ones: a server's first requests may load, compile or warm the model
IDLE_CPU_WINDOW_S = 2.0  # the idle server's own CPU use (poll loops, heartbeats) is measured over this long


def run(
    session: Session,
    *,
    url: str | None = None,
    served_model: str | None = None,
    dialect: str | None = None,
    api_key_env: str | None = None,
    server_pid: int | None = None,
    server_mode: str | None = None,
    abandoned: int = 2,
    prompt_tokens: int = 32,
    prefill_prompt_tokens: int = 512,
    max_new_tokens: int = 128,
    tokens_read: int = 4,
    probes: int = 3,
    settle_timeout_s: float = 60.0,
) -> ExperimentResult:
    """One row per target, request kind and phase: the notebook's own engine (the control), then the server at
    `url` if given (loaded in a session of its own with the same model folder for its tokenizer)."""
    if url is None and (server_pid is not None or server_mode is not None):
        raise ValueError("server_pid and server_mode describe the server at url: give url too, or leave them None")
    cpu = None if server_pid is None else ServerCpu(server_pid)
    targets = [
        _Target(
            "exlnb " + session.status().engine,
            f"exlnb's {session.status().engine} engine in the kernel",
            session,
            None,
            ("streaming",),
        )
    ]
    server = None
    if url is not None:
        server = Session()
        server.load(
            session.options.model_dir,
            url=url,
            served_model=served_model,
            dialect=dialect,
            api_key_env=api_key_env,
            progress=False,
        )
        library = server.status().library
        targets.append(
            _Target(f"{library} server", server_mode or f"{library} server (mode not given)", server, cpu, REQUESTS)
        )
    sizes = _Sizes(
        abandoned, prompt_tokens, prefill_prompt_tokens, max_new_tokens, tokens_read, probes, settle_timeout_s
    )
    try:
        rows, probe_rows = _measure_all(targets, sizes)
    finally:
        if server is not None:
            server.unload()
    parameters = dict(
        url=url,
        served_model=served_model,
        dialect=dialect,
        server_pid=server_pid,
        server_mode=server_mode,
        abandoned=abandoned,
        prompt_tokens=prompt_tokens,
        prefill_prompt_tokens=prefill_prompt_tokens,
        max_new_tokens=max_new_tokens,
        tokens_read=tokens_read,
        probes=probes,
        settle_timeout_s=settle_timeout_s,
    )
    probe_table = pd.DataFrame(probe_rows)
    return ExperimentResult(
        name="disconnect",
        field_reports=(1,),
        tables={"phases": pd.DataFrame(rows), "probes": probe_table},
        effects=_effects(probe_table),
        parameters=parameters,
        environment=environment(session),
        findings=[finding(r) for r in rows],
    )


def _measure_all(targets: list[_Target], sizes: _Sizes) -> tuple[list[dict], list[dict]]:
    """Every target's idle probes, then a row per request kind and phase, with a text bar of the phases (a
    server that runs on for nobody can hold a phase for its whole settle timeout)."""
    rows, probe_rows = [], []
    with tqdm(total=sum(len(t.requests) * len(PHASES) for t in targets), desc="disconnect", unit="phase") as bar:
        for target in targets:
            measure = _Measure(target, sizes, bar)
            probe_rows += measure.idle()
            for request in target.requests:
                for phase in PHASES:
                    bar.set_description(f"{target.name}: {request} request, left while {phase}")
                    row, after = measure.abandon_then_watch(request, phase)
                    rows.append(row)
                    probe_rows += after
                    bar.update()
    return rows, probe_rows


@dataclass(frozen=True)
class _Target:
    name: str
    mode: str  # how it runs: "transformers serve --continuous-batching", "exlnb's cpu engine in the kernel"
    session: Session
    cpu: ServerCpu | None  # its process's CPU, where exlnb started it on this machine
    requests: tuple[str, ...]  # the request kinds it is sent


@dataclass(frozen=True)
class _Sizes:
    abandoned: int
    prompt_tokens: int
    prefill_tokens: int
    max_new_tokens: int
    tokens_read: int
    probes: int
    settle_timeout_s: float


class _Measure:
    """Probes, abandonments and the server-side signals on one target, every request built from its tokenizer."""

    def __init__(self, target: _Target, sizes: _Sizes, bar: tqdm) -> None:
        self.target, self.session, self.sizes, self.bar = target, target.session, sizes, bar
        self.count = 0
        self.idle_ttft = self.prefill_ttft = self.probe_cpu_s = self.idle_cores = 0.0
        self.left_after: dict[str, float] = {}  # phase -> when its streams were left, after sending them
        self.metrics = engine_spec(self.session.options.engine).can("server_metrics")

    def _spec(self, length: int, max_new_tokens: int, stop_at_eos: bool):
        self.count += 1  # every prompt its own: no server reuses a cached prefix between them
        ids = filler_ids(self.session.tokenizer, length, label=f"Request {self.count} of {self.target.name}")
        options = JobOptions(max_new_tokens=max_new_tokens, sampler=SamplerSettings.greedy(), stop_at_eos=stop_at_eos)
        return self.session.spec_for(ids, options)

    def probe(self, length: int | None = None) -> tuple[float, float]:
        """One probe, the short prompt (or `length` tokens) and two tokens: when it was sent, and its time to
        first token."""
        spec = self._spec(length or self.sizes.prompt_tokens, 2, True)
        sent = wall_clock()
        return sent, self.session.submit(spec).result().time_to_first_token_s

    def probe_after_leaving(self) -> tuple[float, float, str | None]:
        """A probe of a server that may still be busy. One whose job fails (its stream sent nothing for the remote
        engine's read timeout, behind work for nobody) counts as waiting until it failed, and its error is kept."""
        started = wall_clock()
        try:
            return (*self.probe(), None)
        except JobError as error:
            return started, wall_clock() - started, str(error)

    def idle(self) -> list[dict]:
        """The idle target's probe times (its reference), its time to first token on the prefill phase's long
        prompt, and where its CPU is read, its idle rate and what a probe costs it."""
        for _ in range(WARM_UPS):
            self.probe()
        self.prefill_ttft = self.probe(self.sizes.prefill_tokens)[1]
        times, costs = [], []
        for _ in range(self.sizes.probes):
            before = self.target.cpu.now() if self.target.cpu else None
            times.append(self.probe()[1])
            if before is not None:
                costs.append(self.target.cpu.now().cpu_s - before.cpu_s)
        self.idle_ttft = statistics.median(times)
        self.metrics = self.metrics and self._running() is not None  # a server without /metrics: no wait for it
        if self.target.cpu is not None:
            self.probe_cpu_s = statistics.median(costs)
            self.idle_cores = self.target.cpu.idle_rate(IDLE_CPU_WINDOW_S)
        return [{"target": self.target.name, "request": "idle", "phase": "idle", "ttft_s": t} for t in times] + [
            {"target": self.target.name, "request": "idle", "phase": "idle, long prompt", "ttft_s": self.prefill_ttft}
        ]

    def abandon_then_watch(self, request: str, phase: str) -> tuple[dict, list[dict]]:
        length = self.sizes.prefill_tokens if phase == "prefill" else self.sizes.prompt_tokens
        # no end of sequence: an abandoned job that runs on runs its whole max_new_tokens, as a load test's do
        specs = [self._spec(length, self.sizes.max_new_tokens, False) for _ in range(self.sizes.abandoned)]
        quiet_before = self._quiet_first()
        sent = wall_clock()
        answered = (
            self._abandon_streams(specs, phase) if request == "streaming" else self._abandon_whole_answers(specs, phase)
        )
        left_at = wall_clock()
        cpu_left = self.target.cpu.now() if self.target.cpu else None
        running = self._running()
        probe_sent, probe, probe_error = self.probe_after_leaving()
        after = [{"target": self.target.name, "request": request, "phase": phase, "ttft_s": probe}]
        recovered_s, probes_sent = self._settle(probe_sent, probe, left_at, after)
        row = {
            "target": self.target.name,
            "mode": self.target.mode,
            "request": request,
            "phase": phase,
            "abandoned": len(specs) - answered,
            "answered_before_leaving": answered,
            "quiet_before": quiet_before,
            "left_after_s": left_at - sent,
            "idle_ttft_s": self.idle_ttft,
            "idle_prefill_ttft_s": self.prefill_ttft,
            "probe_ttft_s": probe,
            "probe_error": probe_error,
            "slowdown": probe / self.idle_ttft,
            "idle_again_after_s": recovered_s,
            "server_running_after": running,
            **self._server_side(left_at, cpu_left, probes_sent),
        }
        return row | verdict(row), after

    def _quiet_first(self) -> bool | None:
        """Where the server's CPU is read, wait for it to be quiet (bounded by the settle timeout), so that a phase
        begins on an idle server even after one whose work outlasted its watch: whether it was (None: not read)."""
        if self.target.cpu is None:
            return None
        self.bar.set_postfix_str("waiting for the server to be quiet before the next phase")
        _, quiet = self.target.cpu.until_quiet(self.idle_cores, wall_clock() + self.sizes.settle_timeout_s)
        self.bar.set_postfix_str("")
        return quiet

    def _abandon_streams(self, specs, phase: str) -> int:
        """Left at once, half-way through the idle long prompt's time to first token, or once every stream has
        `tokens_read` tokens: how many had ended by then."""
        sent = wall_clock()
        streams = self.session.submit_together(specs)
        if phase == "prefill":
            time.sleep(self._prefill_leave_s())
        elif phase == "decode":
            readers = [iter(stream) for stream in streams]  # held, so that no reader's end cancels its job early
            for reader in readers:
                while next(reader).new_tokens < self.sizes.tokens_read:
                    pass
        self.left_after[phase] = wall_clock() - sent
        # on a server: the connection closes, all the server is told; a stream whose job had ended was answered
        # (one generate() at a time, a second stream's first tokens come after the first has finished)
        return sum(not stream.cancel() for stream in streams)

    def _abandon_whole_answers(self, specs, phase: str) -> int:
        """Left when the streaming requests of the same phase were (at once while queued)."""
        leave_after_s = (
            whole_answers.AT_ONCE_S
            if phase == "queued"
            else self._prefill_leave_s()
            if phase == "prefill"
            else self.left_after[phase]
        )
        requests = whole_answers.whole_answer_requests(self.session, specs)
        return whole_answers.abandon(requests, leave_after_s)

    def _prefill_leave_s(self) -> float:
        """Half the idle server's time to first token on the long prompt: in the middle of its prefill."""
        return self.prefill_ttft / 2

    def _settle(self, sent: float, probe: float, left_at: float, after: list[dict]) -> tuple[float | None, int]:
        """Probe until one is near the idle figure (bounded by the settle timeout): seconds from leaving to
        sending it (None if none was), and how many probes were sent."""
        count = 1
        while probe > RECOVERED * self.idle_ttft:
            if wall_clock() - left_at > self.sizes.settle_timeout_s:
                return None, count
            self.bar.set_postfix_str(f"probe {count + 1}: {probe / self.idle_ttft:.1f}x idle")
            time.sleep(SETTLE_PAUSE_S)
            sent, probe, _ = self.probe_after_leaving()
            count += 1
            after.append(
                {"target": self.target.name, "request": after[0]["request"], "phase": "settling", "ttft_s": probe}
            )
        self.bar.set_postfix_str("")
        return sent - left_at, count

    def _server_side(self, left_at: float, cpu_left, probes_sent: int) -> dict:
        """The `/metrics` running count and the CPU used for nobody (with what was taken off it: the probes' idle
        cost and the idle rate), read once a delayed abort has had its time."""
        cpu = self.target.cpu
        read = {
            "server_running_after_wait": None,
            "server_cpu_after_left_s": None,
            "server_quiet_after_s": None,
            "server_idle_cores": None,
            "probe_cpu_s": None,
            "probes_sent": probes_sent,
        }
        if not self.metrics and cpu is None:
            return read
        self.bar.set_postfix_str(f"waiting {ABORT_WAIT_S:g} s for a delayed abort")
        time.sleep(max(0.0, left_at + ABORT_WAIT_S - wall_clock()))
        read["server_running_after_wait"] = self._running()
        if cpu is not None:
            self.bar.set_postfix_str("watching the server's CPU until it is quiet")
            quiet, went_quiet = cpu.until_quiet(self.idle_cores, left_at + self.sizes.settle_timeout_s)
            read |= {
                "server_cpu_after_left_s": quiet.cpu_s
                - cpu_left.cpu_s
                - probes_sent * self.probe_cpu_s
                - self.idle_cores * (quiet.at - cpu_left.at),
                "server_quiet_after_s": quiet.at - left_at if went_quiet else None,
                "server_idle_cores": self.idle_cores,
                "probe_cpu_s": self.probe_cpu_s,
            }
        self.bar.set_postfix_str("")
        return read

    def _running(self) -> float | None:
        if not self.metrics:
            return None
        metrics = self.session.run_on_engine(lambda engine: engine.server_metrics())
        return None if metrics is None else metrics.running


def _effects(probes: pd.DataFrame) -> list[Effect]:
    """Per target, the probe right after leaving a stream in decode against the idle probes."""
    effects = []
    for target, rows in probes.groupby("target", sort=False):
        idle = rows[rows.phase == "idle"].ttft_s
        decode = rows[(rows.phase == "decode") & (rows.request == "streaming")].ttft_s
        if len(idle) and len(decode):
            effects.append(
                Effect(
                    name=f"{target}: probe time to first token",
                    symptom=median_interval(decode.tolist(), "s"),
                    fix=median_interval(idle.tolist(), "s"),
                    symptom_label="after leaving a stream in decode",
                    fix_label="idle",
                    ratio=ratio_of_medians(decode.tolist(), idle.tolist()),
                )
            )
    return effects


def plot(result: ExperimentResult):
    """Probe TTFT per phase and request kind, each target's idle probes as the reference; beside it, the server's
    CPU for nobody per row where it was read."""
    probes, phases = result.tables["probes"], result.tables["phases"]
    if probes.empty:
        return None
    probes = probes[probes.phase != "settling"].assign(
        left=lambda t: [_condition(r, p) for r, p in zip(t.request, t.phase)]
    )
    order = ["idle", *(_condition(r, p) for r in REQUESTS for p in PHASES)]
    cpu = phases.dropna(subset=["server_cpu_after_left_s"]) if "server_cpu_after_left_s" in phases else phases[:0]
    figure, axes = plt.subplots(1, 2 if len(cpu) else 1, figsize=(13 if len(cpu) else 9, 4), squeeze=False)
    sns.stripplot(
        data=probes,
        x="left",
        y="ttft_s",
        hue="target",
        order=[o for o in order if o in set(probes.left)],
        dodge=True,
        ax=axes[0][0],
    )
    axes[0][0].set(
        yscale="log",
        ylabel="probe time to first token (s)",
        xlabel="abandoned while",
        title="Does the server stop when the client leaves?",
    )
    axes[0][0].tick_params(axis="x", labelrotation=30)
    if len(cpu):
        labels = [_condition(r, p) for r, p in zip(cpu.request, cpu.phase)]
        axes[0][1].bar(labels, cpu.server_cpu_after_left_s)
        axes[0][1].axhline(CPU_WORK_S, color="grey", linestyle="--", label=f"{CPU_WORK_S:g} s: worked on")
        axes[0][1].set(
            ylabel="server CPU after the client left (s)",
            xlabel="abandoned while",
            title=f"{cpu.target.iloc[0]}: {cpu['mode'].iloc[0]}",
        )
        axes[0][1].tick_params(axis="x", labelrotation=30)
        axes[0][1].legend()
    figure.tight_layout()
    return figure


def _condition(request: str, phase: str) -> str:
    return phase if request in ("streaming", "idle") else f"{phase}, non-streaming"
