"""A model over several GPUs of one host, through the magics: a layer split gives one card's greedy tokens,
tensor parallelism loads, streams and shows each card's memory, and a split the machine cannot hold is refused in
one line while the loaded model stays. These need two or more CUDA GPUs (`pytest -m gpu` on such a machine);
`python -m benchmarks.multigpu` measures the speeds and the model larger than one card."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
if GPUS < 2:
    pytest.skip(f"several GPUs needed: this machine has {GPUS}", allow_module_level=True)
pytest.importorskip("exllamav2", reason="the layer split and tensor parallelism run on exllamav2 here")

from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from exlnb import SamplerSettings, get_session  # noqa: E402
from exlnb.random_model import LLAMA_7B, random_llama  # noqa: E402

PROMPT = list(range(1000, 1032))  # token ids: the random model's text means nothing
CARD_GIB = int(min(torch.cuda.get_device_properties(i).total_memory for i in range(GPUS)) / 2**30)


@pytest.fixture(scope="module")
def seven_b():
    with random_llama(LLAMA_7B) as (folder, _):
        yield folder
    get_session().unload()


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("exlnb")
    return shell


def greedy(session, tokens: int = 48) -> list[int]:
    result = session.complete(PROMPT, max_new_tokens=tokens, sampler=SamplerSettings.greedy(), stop_at_eos=False)
    return list(result.token_ids)


@pytest.mark.parametrize("engine", ["exllamav2", "exllamav3"])
def test_a_layer_split_decodes_from_a_graph_per_card_and_gives_one_cards_greedy_tokens(seven_b, shell, engine):
    pytest.importorskip(engine)
    session = get_session()
    shell.run_line_magic("exl_load", f"{seven_b} --engine {engine} --graphs off")
    one_card = greedy(session)
    shell.run_line_magic("exl_load", f"{seven_b} --engine {engine} --gpu-split 7,{CARD_GIB}")
    status = session.status()
    assert "cuda:0" in status.line() and "cuda:1" in status.line(), status.line()
    assert status.decode.startswith("CUDA graphs on 2 GPUs"), (status.decode, status.notes)
    assert greedy(session) == one_card


def test_tensor_parallel_streams_through_the_magic_and_shows_each_cards_memory(seven_b, shell):
    pytest.importorskip("exllamav3", reason="tensor parallelism over fp16 weights runs on exllamav3")
    session = get_session()
    shell.run_line_magic(
        "exl_load", f"{seven_b} --engine exllamav3 --tensor-parallel --gpu-split {CARD_GIB},{CARD_GIB}"
    )
    used = [gib for gib in session.status().device_memory_per_gpu if gib > 0]
    assert len(used) >= 2, session.status().line()
    shell.run_cell_magic("exl_generate", "--max-new-tokens 8 --display text --template raw --out streamed", "Hello")
    streamed = shell.user_ns.pop("streamed")
    assert streamed.new_tokens == 8
    shell.run_line_magic("exl_jobs", "")


def test_tensor_parallel_over_fp16_weights_on_exllamav2_is_refused_before_unloading(seven_b, shell):
    session = get_session()
    shell.run_line_magic("exl_load", f"{seven_b} --engine exllamav2 --graphs off")
    before = session.status().line()
    with pytest.raises(UsageError, match="splits only EXL2 weights with tensor parallelism") as refused:
        shell.run_line_magic("exl_load", f"{seven_b} --engine exllamav2 --tensor-parallel")
    assert "\n" not in str(refused.value)
    assert session.status().line() == before


def test_a_split_over_more_gpus_than_the_machine_has_leaves_the_model_loaded(seven_b, shell):
    session = get_session()
    shell.run_line_magic("exl_load", f"{seven_b} --engine exllamav2 --gpu-split 7,{CARD_GIB}")
    before = session.status().line()
    too_many = ",".join(["10"] * (GPUS + 1))
    with pytest.raises(UsageError, match=f"names {GPUS + 1} GPUs; this machine has {GPUS}") as refused:
        shell.run_line_magic("exl_load", f"{seven_b} --engine exllamav2 --gpu-split {too_many}")
    assert "\n" not in str(refused.value)
    assert session.status().line() == before
