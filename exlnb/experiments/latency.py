"""Field report 1, cause A: streams abandoned without cancelling their jobs.

A service handles requests one after another; each consumer stops after a few tokens on its own stop
condition. Without a cancel (`cancel_when_abandoned=False`, the reporter's `async for` + `break`) every
job keeps generating to `max_new_tokens` with nobody reading: it holds cache pages and a batch slot, and
later requests queue behind it. With the cancel (exlnb's default) each job ends with its consumer.

Measured per condition: each request's time to the tokens its consumer wanted, the time of one normal
request afterwards ("the next job"), and, sampled over time, the jobs in the engine and the pages they hold.
On the session's model and, where a GPU has room for it, on a 7B-shaped model with random weights (the
reporter's model size; `timed_models`) with a cache of as many pages.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from exlnb.analysis import mean_interval, median_interval, ratio_of_medians
from exlnb.datasets import load_prompts
from exlnb.engines.base import SamplerSettings, Stage, wall_clock
from exlnb.experiments import timed_models
from exlnb.experiments.record import Effect, ExperimentResult, environment
from exlnb.session import Session
from exlnb.templates import chatml

CONDITIONS = (("cancelled", True), ("un-cancelled", False))  # label, cancel_when_abandoned
TABLES = ("requests", "timeline", "state", "pages")  # what one request sequence records
NEXT_JOB_PROMPT = "What is the capital of France?"
# the reporter's numbers: ~5 s per request at first, up to 5 minutes after ~100 requests (RTX 4090, Mistral 7B)
REPORTED = {"first_request_s": 5.0, "late_request_s": 300.0, "requests": 100}


def run(
    session: Session,
    *,
    requests: int = 8,
    tokens_read: int = 4,
    max_new_tokens: int = 80,
    next_job_tokens: int = 16,
    trials: int = 3,
    sample_interval_s: float = 0.2,
    seed: int = 0,
    models: tuple[str, ...] = timed_models.TIMED_MODELS,
) -> ExperimentResult:
    """Run the same request sequence with and without cancelling abandoned streams, `trials` times each, on
    each of `models` (the 7B-shaped one gets a cache of as many pages as the session's).

    The conditions alternate within each trial, so a machine that gets busier or quieter during the run
    affects both alike.
    """
    if tokens_read >= max_new_tokens:
        raise ValueError(
            f"tokens_read={tokens_read} must be below max_new_tokens={max_new_tokens}: the consumer stops early"
        )
    timed_models.check_model_names(models)
    parameters = dict(
        requests=requests,
        tokens_read=tokens_read,
        max_new_tokens=max_new_tokens,
        next_job_tokens=next_job_tokens,
        trials=trials,
        sample_interval_s=sample_interval_s,
        seed=seed,
        models=list(models),
    )
    sequence = dict(
        requests=requests,
        tokens_read=tokens_read,
        max_new_tokens=max_new_tokens,
        next_job_tokens=next_job_tokens,
        sample_interval_s=sample_interval_s,
        seed=seed,
    )
    rows: dict[str, list[dict]] = {table: [] for table in TABLES}
    not_timed = []
    for model in models:
        if reason := timed_models.cannot_time(model):
            not_timed.append(f"{model}: {reason}; its requests were not timed.")
            continue
        with timed_models.session_for(model, session, session.status().cache_tokens) as timed:
            for table, new_rows in _trials(timed, trials, sequence).items():
                rows[table] += [{"model": model, **row} for row in new_rows]
    tables = {name: pd.DataFrame(table, columns=None if table else ["model"]) for name, table in rows.items()}
    return _summarise(tables, parameters, not_timed, environment(session))


def _trials(session: Session, trials: int, sequence: dict) -> dict[str, list[dict]]:
    """`trials` rounds of the request sequence on one session's model, both conditions in each round."""
    rows: dict[str, list[dict]] = {table: [] for table in TABLES}
    for trial in range(trials):
        for label, cancel in CONDITIONS:
            for table, new_rows in _sequence(session, cancel, **sequence).items():
                rows[table] += [{"trial": trial, "condition": label, **row} for row in new_rows]
    return rows


def _sequence(
    session: Session,
    cancel: bool,
    requests: int,
    tokens_read: int,
    max_new_tokens: int,
    next_job_tokens: int,
    sample_interval_s: float,
    seed: int,
) -> dict[str, list[dict]]:
    """One sequence of requests, then the next job; what the monitor saw; the state the consumers left."""
    prompts = load_prompts("long_answers")
    _wait_until_idle(session)
    with SessionMonitor(session, sample_interval_s) as monitor:
        request_rows = [
            _request(session, prompts[index % len(prompts)], index, tokens_read, max_new_tokens, seed + index, cancel)
            for index in range(requests)
        ]
        left_behind, view = session.jobs(), session.cache_view()
        next_job = _next_job(session, next_job_tokens)
    state = {
        "jobs_left_when_consumers_gone": len(left_behind),
        "unread_jobs_left": sum(1 for row in left_behind if not row.consumed),
        "pages_held_when_consumers_gone": view.total_pages - view.free_pages,
        "total_pages": view.total_pages,
        # exllamav2 defragments only when idle after touching every page (field report 1's background)
        "defrags_so_far": view.defrag_count,
        "next_job_elapsed_s": next_job.elapsed_s,
        "next_job_ttft_s": next_job.time_to_first_token_s,
        "jobs_cancelled_at_cleanup": session.cancel_all(),
    }
    return {
        "requests": request_rows,
        "timeline": monitor.samples,
        "state": [state],
        "pages": [{**asdict(page), "owners": " ".join(map(str, page.owners))} for page in view.pages],
    }


def abandon(session: Session, *, requests: int, tokens_read: int, max_new_tokens: int, seed: int = 0) -> None:
    """Send `requests` requests whose consumers leave without cancelling, and return with their jobs running:
    the state to look at with the cache inspector and the job table. `session.cancel_all()` ends them."""
    prompts = load_prompts("long_answers")
    for index in range(requests):
        _request(session, prompts[index % len(prompts)], index, tokens_read, max_new_tokens, seed + index, cancel=False)


@dataclass(frozen=True)
class SessionSample:
    t_s: float  # seconds since the monitor started
    pending_jobs: int
    active_jobs: int
    unread_jobs: int  # jobs nobody is iterating right now
    pages_held: int


class SessionMonitor:
    """Samples the job table and the cache view on a background thread, as a dashboard would."""

    def __init__(self, session: Session, interval_s: float) -> None:
        self._session = session
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="exlnb-monitor", daemon=True)
        self.samples: list[dict] = []

    def __enter__(self) -> SessionMonitor:
        self._start = wall_clock()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample_until_stopped(self) -> None:
        while not self._stop.is_set():
            rows = self._session.jobs()
            sample = SessionSample(
                t_s=wall_clock() - self._start,
                pending_jobs=sum(1 for r in rows if r.info.stage is Stage.PENDING),
                active_jobs=sum(1 for r in rows if r.info.stage is not Stage.PENDING),
                unread_jobs=sum(1 for r in rows if not r.consumed),
                pages_held=_pages_held(self._session),
            )
            self.samples.append(asdict(sample))
            self._stop.wait(self._interval)


def _request(session, prompt, index, tokens_read, max_new_tokens, seed, cancel) -> dict:
    """One request whose consumer leaves after `tokens_read` tokens (or earlier, at the end of the job)."""
    start = wall_clock()
    stream = session.generate(
        chatml(prompt),
        max_new_tokens=max_new_tokens,
        seed=seed,
        identifier=f"request {index}",
        cancel_when_abandoned=cancel,
    )
    received, first, last = 0, None, None
    for event in stream:
        received += len(event.token_ids)
        if event.token_ids and first is None:
            first = wall_clock()
        if received >= tokens_read or event.eos:
            last = wall_clock()
            break
    return {
        "request": index,
        "latency_s": last - start,  # what this request's client waited for the tokens it wanted
        "ttft_s": first - start if first else None,
        "tokens_received": received,
        "job_ended_by_itself": stream.done,
        "t_submitted_s": start,
    }


def _next_job(session: Session, max_new_tokens: int):
    """A normal request, read to the end: what the next user of the service experiences."""
    return session.complete(
        chatml(NEXT_JOB_PROMPT),
        max_new_tokens=max_new_tokens,
        sampler=SamplerSettings.greedy(),
        stop_at_eos=False,  # same work in both conditions: exactly max_new_tokens tokens
        identifier="next job",
    )


def _pages_held(session: Session) -> int:
    view = session.cache_view()
    return view.total_pages - view.free_pages


def _wait_until_idle(session: Session, timeout_s: float = 30.0) -> None:
    """Cancels asked for by finalisers are queued on the engine thread; let them land before measuring."""
    deadline = wall_clock() + timeout_s
    while session.jobs():
        if wall_clock() > deadline:
            raise RuntimeError(f"jobs still running after {timeout_s} s: {session.jobs()}; cancel them first")
        time.sleep(0.02)


def _summarise(tables: dict[str, pd.DataFrame], parameters: dict, not_timed: list[str], env: dict) -> ExperimentResult:
    effects, findings, by_model = [], [], {}
    for model in dict.fromkeys(tables["requests"].model):  # in the order timed
        own = {name: table[table.model == model] for name, table in tables.items()}
        model_effects = _effects(own, parameters, timed_models.effect_prefix(model))
        by_model[model] = _values(own)
        effects += model_effects
        subject = timed_models.finding_subject(model)
        findings += [subject + line for line in _findings(model_effects, by_model[model], parameters)]
    first = next(iter(by_model.values()), {})
    values = {**first, "by_model": by_model, "not_timed": not_timed, "reported": REPORTED}
    return ExperimentResult(
        name="latency",
        field_reports=(1,),
        tables=tables,
        effects=effects,
        parameters=parameters,
        environment=env,
        findings=findings + not_timed,
        values=values,
    )


def _effects(tables: dict[str, pd.DataFrame], parameters: dict, who: str) -> list[Effect]:
    """One model's two effects of the cancel; `who` names a model other than the session's."""
    requests, state = tables["requests"], tables["state"]
    latency = {label: requests[requests.condition == label].latency_s for label, _ in CONDITIONS}
    next_job = {label: state[state.condition == label].next_job_elapsed_s for label, _ in CONDITIONS}
    trials, n = parameters["trials"], parameters["requests"]
    return [
        Effect(
            name=f"{who}next job ({parameters['next_job_tokens']} tokens, read to the end) after {n} requests, "
            f"median of {trials} trials",
            symptom=median_interval(next_job["un-cancelled"], "s"),
            fix=median_interval(next_job["cancelled"], "s"),
            symptom_label="un-cancelled",
            fix_label="cancelled",
            ratio=ratio_of_medians(next_job["un-cancelled"], next_job["cancelled"]),
        ),
        # the mean, not the median: the symptom is the occasional request that waits for whole jobs to finish
        Effect(
            name=f"{who}request latency (time to {parameters['tokens_read']} tokens), "
            f"mean of {n} requests x {trials} trials",
            symptom=mean_interval(latency["un-cancelled"], "s"),
            fix=mean_interval(latency["cancelled"], "s"),
            symptom_label="un-cancelled",
            fix_label="cancelled",
        ),
    ]


def _values(tables: dict[str, pd.DataFrame]) -> dict:
    requests, state, timeline = tables["requests"], tables["state"], tables["timeline"]
    by_condition = state.groupby("condition")
    return {
        "max_request_latency_s": {c: float(g.latency_s.max()) for c, g in requests.groupby("condition")},
        "median_latency_by_request_s": {
            c: [float(v) for v in g.groupby("request").latency_s.median()] for c, g in requests.groupby("condition")
        },
        "jobs_left_when_consumers_gone": {c: int(g.jobs_left_when_consumers_gone.max()) for c, g in by_condition},
        "pages_held_when_consumers_gone": {c: int(g.pages_held_when_consumers_gone.max()) for c, g in by_condition},
        "total_pages": int(state.total_pages.iloc[0]),
        "max_unread_jobs": {c: int(g.unread_jobs.max()) for c, g in timeline.groupby("condition")},
        "max_pending_jobs": {c: int(g.pending_jobs.max()) for c, g in timeline.groupby("condition")},
        "max_pages_held": {c: int(g.pages_held.max()) for c, g in timeline.groupby("condition")},
    }


def _findings(effects: list[Effect], values: dict, parameters: dict) -> list[str]:
    next_job = effects[0]
    n, left, pages = (
        parameters["requests"],
        values["jobs_left_when_consumers_gone"],
        values["pages_held_when_consumers_gone"],
    )
    by_request = values["median_latency_by_request_s"]["un-cancelled"]
    slowest = max(range(len(by_request)), key=by_request.__getitem__)
    lines = [
        f"Without the cancel, up to {left['un-cancelled']} of {n} jobs were still generating after their consumers had "
        f"left, holding {pages['un-cancelled']} of {values['total_pages']} cache pages; with it, "
        f"{left['cancelled']} jobs and {pages['cancelled']} pages outlived their consumers.",
        f"The next request took {next_job.symptom.value:.2f} s without the cancel and {next_job.fix.value:.2f} s with "
        f"it ({next_job.ratio.value:.1f}x, 95% CI {next_job.ratio.low:.1f}-{next_job.ratio.high:.1f}).",
        "Un-cancelled request latency by request index (median over trials): "
        + ", ".join(f"{v:.2f}" for v in by_request)
        + f" s; the reporter saw about {REPORTED['first_request_s']:.0f} s grow to {REPORTED['late_request_s']:.0f} s "
        f"over about {REPORTED['requests']} requests.",
    ]
    if slowest < len(by_request) - 1 and by_request[slowest + 1] < 0.5 * by_request[slowest]:
        lines.append(
            f"Request {slowest} waited {by_request[slowest]:.2f} s for abandoned jobs to finish and free their pages; "
            f"the one after it took {by_request[slowest + 1]:.2f} s: slow, then briefly fast again, as the reporter "
            "describes."
        )
    return lines


def plot(result: ExperimentResult):
    """Request latency by request index; jobs nobody reads and pages held over time (one line per trial); the
    cache's pages when the next job arrived (the engine's own page table: exllamav2's on the GPU). With a
    second model timed, line styles tell the models apart; the page map is the first model's. None where no
    model was timed: the findings say why."""
    requests, timeline = result.tables["requests"], result.tables["timeline"]
    if requests.empty:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2), gridspec_kw={"width_ratios": [1, 1, 1, 0.8]})
    style = "model" if requests.model.nunique() > 1 else None
    sns.lineplot(data=requests, x="request", y="latency_s", hue="condition", style=style, marker="o", ax=axes[0])
    axes[0].set(
        yscale="log",
        xlabel="request index",
        ylabel="latency to the tokens wanted (s)",
        title="Field report 1: request latency",
    )
    for ax, column, label in (
        (axes[1], "unread_jobs", "jobs nobody reads"),
        (axes[2], "pages_held", "cache pages held"),
    ):
        sns.lineplot(
            data=timeline,
            x="t_s",
            y=column,
            hue="condition",
            style=style,
            units="trial",
            estimator=None,
            drawstyle="steps-post",
            ax=ax,
        )
        ax.set(xlabel="time since the first request (s)", ylabel=label, title=label.capitalize() + " over time")
    total = result.values["total_pages"]
    axes[2].axhline(total, color="grey", linestyle=":", label=f"all {total} pages")
    axes[2].legend()
    pages = result.tables["pages"]
    _page_map(pages[pages.model == pages.model.iloc[0]], axes[3])
    fig.tight_layout()
    return fig


def _page_map(pages: pd.DataFrame, ax) -> None:
    """Each page's reference count and owner jobs when the next job arrived, first trial."""
    first = pages[pages.trial == pages.trial.min()]
    ref_counts = first.pivot(index="condition", columns="index", values="ref_count")
    owners = first.pivot(index="condition", columns="index", values="owners").fillna("")
    sns.heatmap(ref_counts, annot=owners, fmt="", cmap="Oranges", vmin=0, cbar_kws={"label": "reference count"}, ax=ax)
    ax.set(xlabel="cache page", ylabel="", title="Pages as the next job came\n(numbers: owner job ids)")
