"""A server process's CPU time, the server-side signal that needs nothing of the server but its PID.

A probe request's time to first token misses work a server does beside it: under `transformers serve
--continuous-batching` the probe joins the batch of an abandoned request and comes back at 1.1x its idle time
while the server runs at full CPU for nobody. The process's own CPU time (every thread's, from /proc) does not
miss it. It is read only where the server runs on this machine and exlnb started it, so its PID is known.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from exlnb.engines.base import wall_clock

SAMPLE_S = 0.5  # one look at the CPU clock per this many seconds while watching: /proc counts in 10 ms ticks
QUIET_CORES = 0.1  # a window using at most this many cores above the idle rate: the server has gone quiet


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds the process has used so far, all its threads (/proc/PID/stat's utime and
    stime). ValueError, saying what to pass, where there is no such process here or no /proc to read."""
    path = Path(f"/proc/{pid}/stat")
    try:
        stat = path.read_text()
    except FileNotFoundError as error:
        if not Path("/proc/self/stat").exists():
            raise ValueError(
                f"server_pid={pid}: this system has no /proc to read a process's CPU time from (Linux "
                "has): pass server_pid=None"
            ) from error
        raise ValueError(
            f"server_pid={pid}: no such process on this machine; pass the PID of the server exlnb "
            "started here, or None where the server runs elsewhere"
        ) from error
    # the name in parentheses may hold spaces: the fields after it are split, utime and stime the 12th and 13th
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuReading:
    """The server's CPU at one moment: its seconds so far and the wall clock when read."""

    at: float
    cpu_s: float


class ServerCpu:
    """One server process's CPU, read as the disconnect investigation needs it: its idle rate, the cost of a
    probe, and how much it used from the client leaving until it went quiet."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        process_cpu_s(pid)  # refused here, at the door, if there is no such process

    def now(self) -> CpuReading:
        return CpuReading(wall_clock(), process_cpu_s(self.pid))

    def idle_rate(self, window_s: float) -> float:
        """Cores the server uses while nobody asks it anything (a poll loop, a heartbeat), over `window_s`."""
        start = self.now()
        time.sleep(window_s)
        return cores(start, self.now())

    def until_quiet(self, idle_cores: float, deadline: float) -> tuple[CpuReading, bool]:
        """Watch until a window of `SAMPLE_S` uses no more than `QUIET_CORES` above `idle_cores`, or until the wall
        clock passes `deadline`: the reading where it went quiet (or the last one), and whether it did."""
        last = self.now()
        while last.at < deadline:
            time.sleep(SAMPLE_S)
            reading = self.now()
            if cores(last, reading) <= idle_cores + QUIET_CORES:
                return last, True
            last = reading
        return last, False


def cores(start: CpuReading, end: CpuReading) -> float:
    """CPU seconds per wall second between two readings: 1.0 is one core busy throughout."""
    return (end.cpu_s - start.cpu_s) / max(end.at - start.at, 1e-9)
