"""exllamav3's generator narrowed to wait for its own stream (exlnb/engines/exllamav3/narrow_wait.py): while a
decoder that queues before the generator's wait is installed, the generator's module sees a `torch` whose
`cuda.synchronize` is the narrow one and everything else torch's own; the last decoder to leave puts torch back.
exllamav3 needs CUDA to import, so a module of the same name stands in for it here; on the GPU the decoder's test
drives the real generator (tests/test_graph_decode.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from exlnb.engines.exllamav3 import narrow_wait


@pytest.fixture
def generator_module(monkeypatch) -> types.ModuleType:
    module = types.ModuleType(narrow_wait.GENERATOR_MODULE)
    module.torch = torch
    monkeypatch.setitem(sys.modules, narrow_wait.GENERATOR_MODULE, module)
    return module


def test_the_generator_s_wait_is_narrowed_while_a_decoder_asks_and_restored_after_the_last(generator_module):
    first = narrow_wait.narrow_the_generator_s_wait()
    second = narrow_wait.narrow_the_generator_s_wait()
    seen = generator_module.torch

    assert seen is not torch and seen.cuda.synchronize is narrow_wait._stream_synchronize
    assert seen.tensor is torch.tensor and seen.cuda.Event is torch.cuda.Event and seen.nn is torch.nn
    assert torch.cuda.synchronize is not narrow_wait._stream_synchronize  # torch itself is untouched
    first()
    assert generator_module.torch is seen  # one decoder still asks for it
    second()
    assert generator_module.torch is torch
