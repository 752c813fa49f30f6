"""Spreading a model over GPUs (issue 18): what `--gpu-split` and `--tensor-parallel` refuse before anything
loads, the split's parsing, and the status line's memory per GPU. Loading over two GPUs needs a machine that
has them; these run everywhere."""

from __future__ import annotations

import inspect

import pytest
from IPython.core.error import UsageError

from exlnb.engines.base import EngineStatus
from exlnb.engines.options import check_gpu_split, parse_gpu_split
from exlnb.session import LoadOptions, Session

H100 = 80 * 2**30
TWO = (H100, H100)


@pytest.mark.parametrize(
    ("engine", "split", "tp", "devices", "says"),
    [
        ("cpu", (20,), False, TWO, "the cpu engine runs on one device; --gpu-split needs exllamav2 or exllamav3"),
        ("cpu", None, True, TWO, "the cpu engine runs on one device; --tensor-parallel needs exllamav2 or exllamav3"),
        ("exllamav2", (20, -4), False, TWO, r"gpu_split=\(20, -4\): give GiB per GPU, each 0 or more"),
        ("exllamav3", (0, 0), False, TWO, "at least one above 0"),
        ("exllamav2", (float("inf"),), False, TWO, "give GiB per GPU"),
        (
            "exllamav2",
            (20, 24, 24),
            False,
            TWO,
            r"names 3 GPUs; this machine has 2 \(cuda:0 80.0 GiB, cuda:1 80.0 GiB\)",
        ),
        ("exllamav2", (20, 96), False, TWO, "gpu_split gives cuda:1 96 GiB; it has 80.0 GiB"),
        ("exllamav3", (20,), False, (), "--gpu-split needs CUDA GPUs, and this machine has none"),
        ("exllamav2", None, True, (H100,), r"tensor_parallel needs at least two GPUs: this machine has one \(cuda:0"),
        ("exllamav2", (40, 0), True, TWO, r"tensor_parallel needs at least two GPUs: gpu_split=\(40, 0\) uses one"),
    ],
)
def test_a_split_that_cannot_load_is_refused_in_one_line(engine, split, tp, devices, says):
    with pytest.raises(ValueError, match=says) as refused:
        check_gpu_split(engine, split, tp, devices)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("engine", "split", "tp"),
    [
        ("exllamav2", (20, 24), False),
        ("exllamav2", (0, 24), False),
        ("exllamav3", (80,), False),
        ("exllamav2", (20, 24), True),
        ("exllamav3", None, True),
    ],
)
def test_a_split_the_gpus_can_hold_passes(engine, split, tp):
    check_gpu_split(engine, split, tp, TWO)


def test_the_session_refuses_a_split_before_it_touches_the_loaded_model(cpu_session):
    before = cpu_session.status()
    for options in (dict(gpu_split=(20, 24)), dict(tensor_parallel=True)):
        with pytest.raises(ValueError, match="the cpu engine runs on one device"):
            cpu_session.load("smollm2-135m-instruct", engine="cpu", progress=False, **options)
    assert cpu_session.status() == before
    assert inspect.signature(Session.load).parameters["tensor_parallel"].default is False


def test_the_split_is_parsed_as_gib_per_gpu():
    assert parse_gpu_split("20,24") == [20.0, 24.0]
    assert parse_gpu_split("0,23.5") == [0.0, 23.5]
    with pytest.raises(ValueError, match="--gpu-split '20;24': give auto, or GiB per GPU separated by commas"):
        parse_gpu_split("20;24")


def test_a_split_given_to_load_as_text_is_read_as_the_flag_reads_it_not_as_characters():
    assert LoadOptions(gpu_split="20,24").gpu_split == (20.0, 24.0)
    assert LoadOptions(gpu_split=[20, 24]).gpu_split == (20, 24)
    assert LoadOptions(gpu_split="auto").gpu_split == "auto"
    with pytest.raises(ValueError, match="^--gpu-split '20;24': give auto, or GiB per GPU separated by commas"):
        LoadOptions(gpu_split="20;24")


def test_a_split_given_as_one_number_says_to_give_a_list(cpu_session):
    before = cpu_session.status()
    with pytest.raises(TypeError) as raised:
        cpu_session.load("smollm2-135m-instruct", engine="exllamav2", gpu_split=20, progress=False)
    assert str(raised.value) == "gpu_split=20: give GiB per GPU as a list, e.g. [20] or [20, 24], or 'auto'"
    assert cpu_session.status() == before


def test_the_status_line_gives_memory_per_gpu_where_the_model_spans_several():
    def status(per_gpu):
        return EngineStatus(
            "exllamav2",
            "m",
            "NVIDIA H100",
            True,
            "flash-attn paged",
            8192,
            "fp16",
            16,
            device_memory_bytes=sum(per_gpu),
            device_memory_per_gpu=per_gpu,
        )

    assert ", cuda:0 6.50 GiB + cuda:1 6.25 GiB" in status((int(6.5 * 2**30), int(6.25 * 2**30))).line()
    one = status((int(13.5 * 2**30),)).line()
    assert ", 13.50 GiB on device" in one and "cuda:0" not in one


@pytest.mark.parametrize(
    ("engine", "fmt", "refused"),
    [
        ("exllamav2", "hf", True),
        ("exllamav2", "exl2", False),
        ("exllamav3", "hf", False),
        ("exllamav3", "exl3", False),
    ],
)
def test_tensor_parallelism_over_weights_the_library_cannot_split_is_refused_in_one_line(
    engine, fmt, refused, tmp_path
):
    from exlnb.engines.options import check_tensor_parallel_format

    if not refused:
        check_tensor_parallel_format(engine, fmt, tmp_path)
        return
    with pytest.raises(
        ValueError, match="splits only EXL2 weights with tensor parallelism; .* is HF: use --gpu-split"
    ) as error:
        check_tensor_parallel_format(engine, fmt, tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("engine", "devices", "says"),
    [
        ("cpu", TWO, "the cpu engine runs on one device; --gpu-split needs exllamav2 or exllamav3"),
        ("exllamav2", (), "--gpu-split needs CUDA GPUs, and this machine has none"),
    ],
)
def test_an_automatic_split_is_refused_where_it_cannot_load(engine, devices, says):
    with pytest.raises(ValueError, match=says):
        check_gpu_split(engine, "auto", False, devices)


def test_an_automatic_split_lets_the_library_fill_the_gpus(tmp_path):
    from exlnb.engines.options import EngineOptions

    check_gpu_split("exllamav3", "auto", True, TWO)
    options = EngineOptions(
        engine="exllamav2",
        model_dir=tmp_path,
        cache_tokens=4096,
        cache_dtype="fp16",
        max_batch_size=8,
        gpu_split="auto",
        paged="auto",
    )
    assert options.split_gib() is None
    assert EngineOptions(**{**options.__dict__, "gpu_split": (20.0, 24.0)}).split_gib() == [20.0, 24.0]


def test_the_magic_reads_auto_as_an_automatic_split_and_says_what_else_it_takes(shell, cpu_session, monkeypatch):
    given = []
    monkeypatch.setattr(
        cpu_session, "load", lambda **options: given.append(options["gpu_split"]) or cpu_session.status()
    )
    for text in ("auto", "20,24"):
        shell.run_line_magic("exl_load", f"--gpu-split {text}")
    assert given == ["auto", [20.0, 24.0]]
    with pytest.raises(UsageError, match="give auto, or GiB per GPU separated by commas"):
        shell.run_line_magic("exl_load", "--gpu-split twenty")


def test_the_inspector_and_the_job_table_show_each_cards_memory_where_the_model_spans_several():
    from exlnb.engines.views import CacheView, PageInfo
    from exlnb.widgets.cache import cache_summary, inspector_html, jobs_html, jobs_text

    pages = (PageInfo(index=0, owners=(), ref_count=0, tokens_filled=0, shared=False),)
    split = CacheView(
        paged=True, page_size=256, pages=pages, max_tokens=256, device_memory_per_gpu=(8 * 2**30, 4 * 2**30, 0)
    )
    one_card = CacheView(paged=True, page_size=256, pages=pages, max_tokens=256, device_memory_per_gpu=(8 * 2**30, 0))
    says = "cuda:0 8.00 GiB + cuda:1 4.00 GiB + cuda:2 0.00 GiB"

    assert says in cache_summary(split) and says in inspector_html(split, [])
    assert says in jobs_text([], split) and says in jobs_html([], 0.0, split)
    assert "cuda:" not in cache_summary(one_card) + jobs_text([], one_card)
