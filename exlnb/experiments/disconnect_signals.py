"""What each signal of the disconnect investigation says about one row, and the row's verdict from them all.

A row is one request kind and phase on one target: requests abandoned, then the next request's time to first
token (the probe), the server's `/metrics` running count, and its process's CPU for nobody, each where it could
be read. A probe alone misses a server that batches the probe with the work it goes on with, and a count read
at once misses an abort that comes late, so the verdict is "stopped" only where every signal read agrees.
"""

from __future__ import annotations

from exlnb.experiments.server_cpu import SAMPLE_S

RECOVERED = 1.5  # a probe within this factor of the idle probe: the server is idle again
SLOWED = 2.0  # a probe slower than this factor of the idle one: the server was still working for nobody
# (between RECOVERED and SLOWED, a probe alone does not tell: the finding then says so)
ABORT_WAIT_S = 3.0  # the server-side signals are read this long after the client left: SGLang aborts a request
# whose client has gone about 2 s later (its watchdog polls the connection), and an abort that comes late is
# still a stop
CPU_WORK_S = 0.5  # CPU seconds beyond the probes' own and the idle rate: work for a client that had left (a
# probe of the bundled model cost the CPU servers 0.26-0.35 s with one thread, 2026-11-27, varying by ~0.1 s)
WORKED, STOPPED, UNCLEAR, UNAVAILABLE = "worked on", "stopped", "unclear", "not available"


def verdict(row: dict) -> dict:
    """What each signal says about one row, and the verdict: "stopped" only where every available signal
    agrees; "kept working (...)" where any one saw work for nobody, with what it saw; "unclear" otherwise; and
    "nothing abandoned" where every request was answered before its client left (a server that runs one request
    at a time can finish the first while the second is still being read)."""
    says = {"probe_says": _probe_says(row), "metrics_says": _metrics_says(row), "cpu_says": _cpu_says(row)}
    worked = [detail for detail, said in zip(_worked_details(row), says.values()) if said == WORKED]
    if not row["abandoned"]:
        text = "nothing abandoned: every request was answered before its client left"
    elif worked:
        text = f"kept working ({'; '.join(worked)})"
    elif all(said in (STOPPED, UNAVAILABLE) for said in says.values()):
        text = "stopped"
    else:
        text = "unclear: the probes stayed slow, though not past the threshold, and no other signal saw work"
    return says | {"verdict": text}


VERDICT_KINDS = ("stopped", "kept working", "unclear", "nothing abandoned")  # how every verdict begins


def verdict_kind(text: str) -> str:
    """ "kept working" of "kept working (9.2 s of CPU ...)": the verdict without what each signal saw."""
    return next(kind for kind in VERDICT_KINDS if text.startswith(kind))


def _probe_says(row: dict) -> str:
    if row["slowdown"] > SLOWED:
        return WORKED
    return UNCLEAR if row["idle_again_after_s"] is None else STOPPED


def _metrics_says(row: dict) -> str:
    running = row["server_running_after_wait"]
    return UNAVAILABLE if running is None else WORKED if running > 0 else STOPPED


def _cpu_says(row: dict) -> str:
    cpu_s = row["server_cpu_after_left_s"]
    return (
        UNAVAILABLE
        if cpu_s is None
        else WORKED
        if cpu_s > CPU_WORK_S or row["server_quiet_after_s"] is None
        else STOPPED
    )


def _worked_details(row: dict) -> tuple[str, str, str]:
    """How each signal words work for nobody, in the order of `verdict`'s signals."""
    cpu_s, quiet_s = row["server_cpu_after_left_s"], row["server_quiet_after_s"]
    busy = (
        ""
        if cpu_s is None
        else " and still busy at the settle timeout"
        if quiet_s is None
        else f", busy for about {quiet_s:.0f} s"
        if quiet_s > ABORT_WAIT_S + SAMPLE_S
        else f", quiet by {ABORT_WAIT_S:g} s after"
    )
    failed = f" and failed ({row['probe_error']})" if row["probe_error"] else ""
    return (
        f"the next request waited {row['slowdown']:.1f}x its idle time{failed}",
        f"/metrics counted {row['server_running_after_wait'] or 0:.0f} running {ABORT_WAIT_S:g} s after it left",
        f"{cpu_s or 0:.1f} s of CPU after the client left{busy}",
    )


def finding(row: dict) -> str:
    """The row in one sentence: its verdict, then every signal's reading (or that it was not available)."""
    probe = (
        f"probe TTFT {row['probe_ttft_s'] * 1000:.0f} ms against {row['idle_ttft_s'] * 1000:.0f} ms idle, "
        f"{row['slowdown']:.1f}x, "
        + (
            "not idle again within the settle timeout"
            if row["idle_again_after_s"] is None
            else f"idle again {row['idle_again_after_s']:.1f} s after the client left"
        )
    )
    running = row["server_running_after_wait"]
    metrics = (
        "/metrics: not available"
        if running is None
        else f"/metrics: {row['server_running_after'] or 0:.0f} running right after, "
        f"{running:.0f} after {ABORT_WAIT_S:g} s"
    )
    cpu_s = row["server_cpu_after_left_s"]
    cpu = (
        "server CPU: not available (exlnb did not start this server here, or it is the control)"
        if cpu_s is None
        else f"server CPU: {cpu_s:.1f} s for nobody"
    )
    answered = (
        f"; {row['answered_before_leaving']} answered before the client left" if row["answered_before_leaving"] else ""
    )
    busy = (
        "; the server was still busy from the phase before when this one began" if row["quiet_before"] is False else ""
    )
    return (
        f"{row['target']} ({row['mode']}), {row['request']} request abandoned while {row['phase']}: "
        f"{row['verdict']} ({probe}; {metrics}; {cpu}{answered}{busy})"
    )
