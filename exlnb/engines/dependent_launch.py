"""Programmatic dependent launch for exlnb's Triton kernels, so a step's launches overlap instead of queuing.

In a 7B step's CUDA graph on an H200 every launch costs its kernel's time and about 0.88 us more: the ExLlamaV2
engine's default step spends 3.873 ms in 231 kernels and takes 4.126 ms (benchmarks/results/
speed-nvidia-h200-2026-11-29-g), 0.25 ms of launches and host a token. On Hopper and later a
kernel launched with programmatic stream serialization may be scheduled while the kernel before it on the stream is
still running: its programs start, wait at `griddepcontrol.wait` until that kernel has finished and its writes are
visible, and only then read or write anything. The kernel before says, after its main loop, that its dependents may
launch (`griddepcontrol.launch_dependents`). A stream capture keeps both as the graph's edges.

Each of exlnb's kernels waits first, before any load or store, so the overlap never lets one read early or
overwrite a buffer the kernel before still reads (a freed buffer's block can be handed to the next kernel's output).
A launch that follows a library kernel (cuBLAS, exllamav2's norm) waits for that kernel's end, as without it.

Off unless `EXLNB_DEPENDENT_LAUNCH=1` (read at each launch, so a graph keeps what it captured; `early` lets the
next kernel start as soon as this one's programs have waited, for the sweep to weigh against after the loop),
until the speed suite times it in turns; never under Triton's interpreter, which runs no inline PTX, before
compute capability 9.0, which has no such instruction, nor with a Triton before 3.3, which has no way to say it.

This module imports triton at its top: callers import it only where CUDA (and with it triton) is present.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_HAS_IT = True
except ImportError:  # an older Triton: the kernels compile without it (PDL is never true there)
    gdc_launch_dependents = gdc_wait = None
    TRITON_HAS_IT = False

VARIABLE = "EXLNB_DEPENDENT_LAUNCH"
# the kernels' PDL constexpr: launched apart; dependent, letting the next start after the main loop; dependent,
# letting it start at once (its programs then wait beside this kernel's on the SMs: for kernels of one wave)
APART, AFTER_THE_LOOP, AT_ONCE = 0, 1, 2
MODES = {"0": APART, "1": AFTER_THE_LOOP, "early": AT_ONCE}  # the variable's values
# Triton reads TRITON_INTERPRET once, when a kernel is defined; so does this
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dependent_launch_mode() -> int:
    """What `EXLNB_DEPENDENT_LAUNCH` asks (0 by default: APART); a value it cannot take refused in one line."""
    value = os.environ.get(VARIABLE, "0")
    if value not in MODES:
        raise ValueError(f"{VARIABLE}={value!r}: one of {', '.join(MODES)}")
    return MODES[value]


def dependent_launch_on() -> bool:
    """Whether exlnb's kernels are asked to launch dependent, where the card can."""
    return dependent_launch_mode() != APART


def dependent_launch(device: torch.device) -> int:
    """How a kernel launched now on `device` waits for the one before it in its own programs (the `PDL`
    constexpr of every exlnb kernel; its launch's `launch_pdl` where not APART)."""
    mode = dependent_launch_mode()
    if mode == APART or INTERPRETED or not TRITON_HAS_IT or device.type != "cuda":
        return APART
    return (
        mode if _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device()) else APART
    )


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_the_kernel_before(PDL: tl.constexpr):
    """A kernel's first statement: nothing it reads or writes may be touched before the kernel before it ends
    (and, AT_ONCE, the next kernel's programs may be scheduled from here on)."""
    if PDL != 0:
        gdc_wait()
    if PDL == 2:  # AT_ONCE
        gdc_launch_dependents()


@triton.jit
def let_the_next_kernel_start(PDL: tl.constexpr):
    """After a kernel's main loop: the next kernel's programs may be scheduled (they still wait for this one)."""
    if PDL == 1:  # AFTER_THE_LOOP
        gdc_launch_dependents()
