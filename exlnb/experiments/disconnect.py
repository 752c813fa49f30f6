"""Does the server stop when the client leaves? (field report 1's abandoned jobs, at a server)

Published 2026 issues show servers generating on for clients that have gone: SGLang (#36876, 182 abandoned
requests on one pod), vLLM (#54947), llama.cpp's server (#24496), TabbyAPI (#428). Here streams are opened and
abandoned in three phases: at once (the request still queued or just admitted), during prefill (a long prompt,
left half-way through the time its first token takes when the server is idle) and during decode (left after
`tokens_read` tokens). Leaving closes the connection; that is all a server is told. Right after, a probe
request's time to first token is measured against the same probe on the idle server: a server that kept
working on the abandoned requests makes the probe wait or share its batch with them. Where the server has a
Prometheus `/metrics`, its own count of running requests after the abandonment says so directly. Then probes
repeat until one is back near the idle figure: how long the server went on working for nobody.

exlnb's own engine, loaded in the notebook, is the control: its session cancels an abandoned job at once.
"""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import median_interval, ratio_of_medians
from exlnb.datasets import filler_ids
from exlnb.engines.base import SamplerSettings, wall_clock
from exlnb.engines.job_options import JobOptions
from exlnb.engines.registry import engine_spec
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.session import Session

PHASES = ("queued", "prefill", "decode")
RECOVERED = 1.5  # a probe within this factor of the idle probe: the server is idle again
SLOWED = 2.0  # a probe slower than this factor of the idle one: the server was still working for nobody
# (between RECOVERED and SLOWED, a probe alone does not tell: the finding then says so)


def run(
    session: Session,
    *,
    url: str | None = None,
    served_model: str | None = None,
    api_key_env: str | None = None,
    abandoned: int = 2,
    prompt_tokens: int = 32,
    prefill_prompt_tokens: int = 512,
    max_new_tokens: int = 128,
    tokens_read: int = 4,
    probes: int = 3,
    settle_timeout_s: float = 60.0,
) -> ExperimentResult:
    """One row per target and phase: the notebook's own engine (the control), then the server at `url` if given
    (loaded in a session of its own with the same model folder for its tokenizer)."""
    targets = [("exlnb " + session.status().engine, session)]
    server = None
    if url is not None:
        server = Session()
        server.load(
            session.options.model_dir, url=url, served_model=served_model, api_key_env=api_key_env, progress=False
        )
        targets.append((f"{server.status().library} server", server))
    rows, probe_rows = [], []
    try:
        for name, target in targets:
            measure = _Measure(target, name, prompt_tokens, prefill_prompt_tokens, max_new_tokens, probes)
            idle = measure.idle_probes()
            probe_rows += [{"target": name, "phase": "idle", "ttft_s": t} for t in idle]
            for phase in PHASES:
                row, after = measure.abandon_then_probe(
                    phase, abandoned, tokens_read, statistics.median(idle), settle_timeout_s
                )
                rows.append(row)
                probe_rows += after
    finally:
        if server is not None:
            server.unload()
    table = pd.DataFrame(rows)
    parameters = dict(
        url=url,
        served_model=served_model,
        abandoned=abandoned,
        prompt_tokens=prompt_tokens,
        prefill_prompt_tokens=prefill_prompt_tokens,
        max_new_tokens=max_new_tokens,
        tokens_read=tokens_read,
        probes=probes,
        settle_timeout_s=settle_timeout_s,
    )
    return ExperimentResult(
        name="disconnect",
        field_reports=(1,),
        tables={"phases": table, "probes": pd.DataFrame(probe_rows)},
        effects=_effects(pd.DataFrame(probe_rows)),
        parameters=parameters,
        environment=environment(session),
        findings=[_finding(r) for r in rows],
    )


class _Measure:
    """Probes and abandonments on one target, every request built from the target's own tokenizer."""

    def __init__(
        self, session: Session, name: str, prompt_tokens: int, prefill_tokens: int, max_new_tokens: int, probes: int
    ) -> None:
        self.session, self.name, self.probes = session, name, probes
        self.prompt_tokens, self.prefill_tokens, self.max_new_tokens = prompt_tokens, prefill_tokens, max_new_tokens
        self.count = 0

    def _spec(self, length: int, max_new_tokens: int, stop_at_eos: bool):
        self.count += 1  # every prompt its own: no server reuses a cached prefix between them
        ids = filler_ids(self.session.tokenizer, length, label=f"Request {self.count} of {self.name}")
        options = JobOptions(max_new_tokens=max_new_tokens, sampler=SamplerSettings.greedy(), stop_at_eos=stop_at_eos)
        return self.session.spec_for(ids, options)

    def probe(self) -> tuple[float, float]:
        """One probe, the short prompt and two tokens: when it was sent, and its time to first token."""
        spec = self._spec(self.prompt_tokens, 2, True)
        sent = wall_clock()
        return sent, self.session.submit(spec).result().time_to_first_token_s

    def idle_probes(self) -> list[float]:
        self.probe()  # the first request may load or warm the model: not an idle figure
        return [self.probe()[1] for _ in range(self.probes)]

    def abandon_then_probe(
        self, phase: str, count: int, tokens_read: int, idle_ttft: float, settle_timeout_s: float
    ) -> tuple[dict, list[dict]]:
        length = self.prefill_tokens if phase == "prefill" else self.prompt_tokens
        # no end of sequence: an abandoned job that runs on runs its whole max_new_tokens, as a load test's do
        streams = self.session.submit_together([self._spec(length, self.max_new_tokens, False) for _ in range(count)])
        if phase == "prefill":
            time.sleep(idle_ttft * self.prefill_tokens / self.prompt_tokens / 2)
        elif phase == "decode":
            readers = [iter(stream) for stream in streams]  # held, so that no reader's end cancels its job early
            for reader in readers:
                while next(reader).new_tokens < tokens_read:
                    pass
        left_at = wall_clock()
        for stream in streams:
            stream.cancel()  # on a server: the connection closes, all the server is told
        metrics = self._server_metrics()
        sent, probe = self.probe()
        after = [{"target": self.name, "phase": phase, "ttft_s": probe}]
        recovered_s = self._settle(idle_ttft, sent, probe, left_at, settle_timeout_s, after)
        row = {
            "target": self.name,
            "phase": phase,
            "abandoned": count,
            "idle_ttft_s": idle_ttft,
            "probe_ttft_s": probe,
            "slowdown": probe / idle_ttft,
            "server_running_after": None if metrics is None else metrics.running,
            "idle_again_after_s": recovered_s,
        }
        return row, after

    def _settle(
        self, idle_ttft: float, sent: float, probe: float, left_at: float, timeout_s: float, after: list[dict]
    ) -> float | None:
        """Probe until one is near the idle figure (bounded by `timeout_s`); seconds from leaving to sending it."""
        while probe > RECOVERED * idle_ttft:
            if wall_clock() - left_at > timeout_s:
                return None
            sent, probe = self.probe()
            after.append({"target": self.name, "phase": "settling", "ttft_s": probe})
        return sent - left_at

    def _server_metrics(self):
        if not engine_spec(self.session.options.engine).can("server_metrics"):
            return None
        return self.session.run_on_engine(lambda engine: engine.server_metrics())


def _effects(probes: pd.DataFrame) -> list[Effect]:
    """Per target, the probe right after leaving in decode against the idle probes."""
    effects = []
    for target, rows in probes.groupby("target", sort=False):
        idle, decode = rows[rows.phase == "idle"].ttft_s, rows[rows.phase == "decode"].ttft_s
        if len(idle) and len(decode):
            effects.append(
                Effect(
                    name=f"{target}: probe time to first token",
                    symptom=median_interval(decode.tolist(), "s"),
                    fix=median_interval(idle.tolist(), "s"),
                    symptom_label="after leaving in decode",
                    fix_label="idle",
                    ratio=ratio_of_medians(decode.tolist(), idle.tolist()),
                )
            )
    return effects


def _finding(row: dict) -> str:
    worked_on = row["slowdown"] > SLOWED or (row["server_running_after"] or 0) > 0
    running = (
        ""
        if row["server_running_after"] is None
        else f"; its /metrics counted {row['server_running_after']:.0f} running right after"
    )
    recovered = (
        "not idle again within the settle timeout"
        if row["idle_again_after_s"] is None
        else f"idle again {row['idle_again_after_s']:.1f} s after the client left"
    )
    verdict = (
        "kept working for the client that left"
        if worked_on
        else "unclear: the probes stayed slow, though not past the threshold"
        if row["idle_again_after_s"] is None
        else "stopped when the client left"
    )
    return (
        f"{row['target']}, abandoned while {row['phase']}: {verdict} (probe TTFT {row['probe_ttft_s'] * 1000:.0f} ms "
        f"against {row['idle_ttft_s'] * 1000:.0f} ms idle, {row['slowdown']:.1f}x{running}; {recovered})"
    )


def plot(result: ExperimentResult):
    """Probe TTFT per phase, each target's idle probes as the reference."""
    probes = result.tables["probes"]
    if probes.empty:
        return None
    figure, axis = plt.subplots(figsize=(8, 3.5))
    sns.stripplot(
        data=probes[probes.phase != "settling"],
        x="phase",
        y="ttft_s",
        hue="target",
        order=["idle", *PHASES],
        dodge=True,
        ax=axis,
    )
    axis.set(
        yscale="log",
        ylabel="probe time to first token (s)",
        xlabel="abandoned while",
        title="Does the server stop when the client leaves?",
    )
    figure.tight_layout()
    return figure
