"""exllamav3's generator narrowed to wait for its own stream, so that a decode step queued on another stream runs
through the generator's host work.

After each decode step exllamav3 1.6.5's generator waits for the whole device (`torch.cuda.synchronize(device)` in
`Generator.iterate_gen`) before it reads the sampled tokens. A step the graph decoder queued behind the one asked
for, on a stream of its own, would be waited for too, and the GPU would idle through the host work that follows
(0.42 ms of a batch-1 step and 0.73 of a batch-8 one on an H200, 2026-11-28). While a decoder that queues before
that wait is installed, the generator's module sees a `torch` whose `cuda.synchronize` waits for the current
stream only, where the generator launches all of its own work.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable

import torch

GENERATOR_MODULE = "exllamav3.generator.generator"  # the module whose `torch` the generator's wait is looked up in
_narrowed = 0  # decoders installed that asked for it (the module is one for all generators in the process)


def _stream_synchronize(device=None) -> None:
    """`torch.cuda.synchronize`, for the current stream of `device` only."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    event.synchronize()


def _torch_with_narrow_wait() -> types.ModuleType:
    cuda = types.ModuleType("torch.cuda")
    cuda.__dict__.update(vars(torch.cuda))
    cuda.synchronize = _stream_synchronize
    shim = types.ModuleType("torch")
    shim.__dict__.update(vars(torch))
    shim.cuda = cuda
    return shim


def narrow_the_generator_s_wait() -> Callable[[], None]:
    """Narrow exllamav3's generator's wait to its stream until the returned function is called."""
    global _narrowed
    module = importlib.import_module(GENERATOR_MODULE)
    if _narrowed == 0:
        module.torch = _torch_with_narrow_wait()
    _narrowed += 1

    def undo() -> None:
        global _narrowed
        _narrowed -= 1
        if _narrowed == 0:
            module.torch = torch

    return undo
