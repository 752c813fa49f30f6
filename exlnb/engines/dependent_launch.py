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

Off unless `EXLNB_DEPENDENT_LAUNCH=1` (read at each launch, so a graph keeps what it captured), until the speed
suite times it in turns; never under Triton's interpreter, which runs no inline PTX, before compute capability
9.0, which has no such instruction, nor with a Triton before 3.3, which has no way to say it.

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
# Triton reads TRITON_INTERPRET once, when a kernel is defined; so does this
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dependent_launch_on() -> bool:
    """Whether exlnb's kernels are launched dependent where the card can (`EXLNB_DEPENDENT_LAUNCH=1`)."""
    return os.environ.get(VARIABLE, "0") == "1"


def dependent_launch(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` waits for the one before it in its own programs (the `PDL`
    constexpr and the `launch_pdl` option of every exlnb kernel's launch)."""
    if not dependent_launch_on() or INTERPRETED or not TRITON_HAS_IT or device.type != "cuda":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_the_kernel_before(PDL: tl.constexpr):
    """A kernel's first statement: nothing it reads or writes may be touched before the kernel before it ends."""
    if PDL:
        gdc_wait()


@triton.jit
def let_the_next_kernel_start(PDL: tl.constexpr):
    """After a kernel's main loop: the next kernel's programs may be scheduled (they still wait for this one)."""
    if PDL:
        gdc_launch_dependents()
