"""Spreading a model over GPUs (issue 18): what `--gpu-split` and `--tensor-parallel` refuse before anything
loads, the split's parsing, and the status line's memory per GPU. Loading over two GPUs needs a machine that
has them; these run everywhere."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from exlnb.engines.base import EngineStatus
from exlnb.engines.options import check_gpu_split
from exlnb.magics import gpu_split
from exlnb.session import Session

H100 = 80 * 2**30
TWO = (H100, H100)


@pytest.mark.parametrize(("engine", "split", "tp", "devices", "says"), [
    ("cpu", (20,), False, TWO, "the cpu engine runs on one device; --gpu-split needs exllamav2 or exllamav3"),
    ("cpu", None, True, TWO, "the cpu engine runs on one device; --tensor-parallel needs exllamav2 or exllamav3"),
    ("exllamav2", (20, -4), False, TWO, r"gpu_split=\(20, -4\): give GiB per GPU, each 0 or more"),
    ("exllamav3", (0, 0), False, TWO, "at least one above 0"),
    ("exllamav2", (float("inf"),), False, TWO, "give GiB per GPU"),
    ("exllamav2", (20, 24, 24), False, TWO, r"names 3 GPUs; this machine has 2 \(cuda:0 80.0 GiB, cuda:1 80.0 GiB\)"),
    ("exllamav2", (20, 96), False, TWO, "gpu_split gives cuda:1 96 GiB; it has 80.0 GiB"),
    ("exllamav3", (20,), False, (), "--gpu-split needs CUDA GPUs, and this machine has none"),
    ("exllamav2", None, True, (H100,), r"tensor_parallel needs at least two GPUs: this machine has one \(cuda:0"),
    ("exllamav2", (40, 0), True, TWO, r"tensor_parallel needs at least two GPUs: gpu_split=\(40, 0\) uses one"),
])
def test_a_split_that_cannot_load_is_refused_in_one_line(engine, split, tp, devices, says):
    with pytest.raises(ValueError, match=says) as refused:
        check_gpu_split(engine, split, tp, devices)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("engine", "split", "tp"), [
    ("exllamav2", (20, 24), False), ("exllamav2", (0, 24), False), ("exllamav3", (80,), False),
    ("exllamav2", (20, 24), True), ("exllamav3", None, True),
])
def test_a_split_the_gpus_can_hold_passes(engine, split, tp):
    check_gpu_split(engine, split, tp, TWO)


def test_the_session_refuses_a_split_before_it_touches_the_loaded_model(cpu_session):
    before = cpu_session.status()
    for options in (dict(gpu_split=(20, 24)), dict(tensor_parallel=True)):
        with pytest.raises(ValueError, match="the cpu engine runs on one device"):
            cpu_session.load("smollm2-135m-instruct", engine="cpu", progress=False, **options)
    assert cpu_session.status() == before
    assert Session.load.__kwdefaults__["tensor_parallel"] is False


def test_the_split_is_parsed_as_gib_per_gpu():
    assert gpu_split("20,24") == [20.0, 24.0]
    assert gpu_split("0,23.5") == [0.0, 23.5]
    with pytest.raises(UsageError, match="--gpu-split '20;24': give GiB per GPU separated by commas"):
        gpu_split("20;24")


def test_the_status_line_gives_memory_per_gpu_where_the_model_spans_several():
    def status(per_gpu):
        return EngineStatus("exllamav2", "m", "NVIDIA H100", True, "flash-attn paged", 8192, "fp16", 16,
                            device_memory_bytes=sum(per_gpu), device_memory_per_gpu=per_gpu)

    assert ", cuda:0 6.50 GiB + cuda:1 6.25 GiB" in status((int(6.5 * 2**30), int(6.25 * 2**30))).line()
    one = status((int(13.5 * 2**30),)).line()
    assert ", 13.50 GiB on device" in one and "cuda:0" not in one
