"""`LoadOptions`, the one door of `Session.load` and `%exl_load`: every load it refuses is refused before the loaded
model is touched, so the model stays as it was, not unloaded and loaded again, on every engine the suite loads
(the CPU engine here, the GPU engines with `pytest -m gpu`) and on a server's (the openai engine)."""

from __future__ import annotations

import inspect

import pytest
from IPython.core.error import UsageError

from exlnb.engines.options import cuda_available
from exlnb.engines.registry import engine_names, engine_spec
from exlnb.session import LoadOptions, Session

pytest_plugins = ["tests.servers"]

SERVER = "http://127.0.0.1:9/v1"  # never reached: every load below is refused before any connection
CUDA_ENGINE = next(name for name in engine_names() if engine_spec(name).needs_cuda)

# each refused load: its options, and what the refusal says (in one line)
REFUSED = {
    "a count of the wrong type": (dict(cache_tokens=1.5), "cache_tokens=1.5 has the wrong type"),
    "a misspelt option": (dict(cache_token=4096), r"unknown option 'cache_token' \(did you mean 'cache_tokens'\?\)"),
    "an unknown engine": (dict(engine="tpu"), "unknown engine 'tpu': choose one of auto"),
    "an unknown cache type": (dict(cache="q5"), "unknown cache type 'q5'"),
    "a cache under one page": (dict(cache_tokens=100), "cache_tokens=100 is too small"),
    "a cache larger than the device": (dict(engine="cpu", cache_tokens=10**12), "GiB for keys and values, more than"),
    "no batch": (dict(max_batch_size=0), "max_batch_size=0 must be >= 1"),
    "an unknown paged mode": (dict(paged="sometimes"), "paged='sometimes' is not one of"),
    "an unknown graphs mode": (dict(graphs="sometimes"), "graphs='sometimes': choose one of auto, off"),
    "a quantized cache the engine lacks": (dict(engine="cpu", cache="q4"), "the cpu engine keeps its cache in full"),
    "unpaged where the engine always pages": (dict(engine="cpu", paged=False), "the cpu engine always pages"),
    "a split the engine cannot make": (dict(engine="cpu", gpu_split=(20, 24)), "the cpu engine runs on one device"),
    "tensor parallelism the engine lacks": (dict(engine="cpu", tensor_parallel=True), "runs on one device"),
    "no model there": (dict(model="no/such/folder"), "no model at .*no/such/folder"),
    "a server's engine without a url": (dict(engine="openai"), "talks to a server: give its url"),
    "a url for an engine of folders": (dict(engine="cpu", url=SERVER), "is for a server"),
    "a url that is no http(s) address": (dict(url="ftp://127.0.0.1/v1"), "is not an http\\(s\\) address"),
    "a url carrying a key": (dict(url="http://me:hunter2@127.0.0.1:9/v1"), "carries credentials or a query"),
    "a key variable that is not set": (
        dict(url=SERVER, api_key_env="EXLNB_NO_SUCH_KEY"),
        "api_key_env='EXLNB_NO_SUCH_KEY': that environment variable is not set",
    ),
    "an unknown server api": (dict(url=SERVER, api="grpc"), "api='grpc': choose one of chat, completions"),
    "an unknown server dialect": (
        dict(url=SERVER, dialect="ollama"),
        "dialect='ollama': choose one of vllm, sglang, tabbyapi, llama.cpp, transformers, openai",
    ),
    "a dialect without a server": (dict(dialect="vllm"), "dialect= names a server's kind: give the server's url too"),
    "an all-reduce the engine has no choice of": (
        dict(engine="cpu", tp_backend="nccl"),
        "the cpu engine has no choice of all-reduce: tp_backend needs",
    ),
    "an engine that needs CUDA where there is none": (dict(engine=CUDA_ENGINE), "needs a CUDA GPU"),
}


def refused_leaves_it_untouched(loaded: Session, case: str, monkeypatch) -> None:
    options, says = REFUSED[case]
    if case.endswith("where there is none") and cuda_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv("EXLNB_NO_SUCH_KEY", raising=False)
    engine, before = loaded.engine, loaded.options

    for reload in (False, True):  # reload=True replaces the model, but only once the new one is known to load
        with pytest.raises((ValueError, TypeError, FileNotFoundError), match=says) as refused:
            loaded.load(**options, reload=reload, progress=False)
        assert "\n" not in str(refused.value) and "hunter2" not in str(refused.value)
        assert loaded.engine is engine and loaded.options == before

    assert loaded.complete("Say hi.", max_new_tokens=16, temperature=0).new_tokens >= 1


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_load_leaves_the_loaded_engine_untouched(engine_session, case, monkeypatch):
    refused_leaves_it_untouched(engine_session, case, monkeypatch)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_load_leaves_the_loaded_server_untouched(fake_session, case, monkeypatch):
    refused_leaves_it_untouched(fake_session, case, monkeypatch)


def test_a_refused_load_at_the_magic_leaves_the_loaded_model_untouched(shell, cpu_session):
    engine = cpu_session.engine
    for line in ("--engine cpu --cache q4", "--url ftp://127.0.0.1/v1", "--cache-tokens 100", "--paged never"):
        with pytest.raises(UsageError):
            shell.run_line_magic("exl_load", line)
    assert cpu_session.engine is engine


def test_an_all_reduce_is_one_of_the_engine_s_and_only_with_tensor_parallelism():
    from exlnb.engines.options import check_tp_backend

    check_tp_backend("exllamav3", "nccl", tensor_parallel=True)
    with pytest.raises(ValueError, match="tp_backend='mpi': the exllamav3 engine's are native, nccl"):
        check_tp_backend("exllamav3", "mpi", tensor_parallel=True)
    with pytest.raises(ValueError, match="tp_backend='nccl' is for tensor parallelism: add tensor_parallel=True"):
        check_tp_backend("exllamav3", "nccl", tensor_parallel=False)


def test_the_signature_and_the_magic_read_the_declaration():
    parameters = inspect.signature(Session.load).parameters
    for field_name, default in LoadOptions.__dataclass_fields__.items():
        if field_name != "model":
            assert parameters[field_name].default == default.default, field_name
    assert LoadOptions.build(engine="cpu").with_options(cache_tokens=4096) == LoadOptions(
        engine="cpu", cache_tokens=4096
    )
