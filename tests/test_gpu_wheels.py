"""Which wheels a CUDA machine without a package index is sent (benchmarks/gpu_wheels.py): the choice, not the
download, which needs PyPI."""

from __future__ import annotations

from packaging.requirements import Requirement

from benchmarks.gpu_wheels import PYPROJECT, applies, exlnb_requirements, name_of, names_in

PIP_LIST = """Package            Version
------------------ -----------
torch              2.11.0
transformers       5.17.0
typing_extensions  4.15.0
"""


def test_a_pip_list_or_freeze_gives_the_names_pip_compares():
    assert names_in(PIP_LIST) == {"torch", "transformers", "typing-extensions"}
    assert names_in("Jinja2==3.1.6\nnest_asyncio @ file:///x\n\nzipp\n") == {"jinja2", "nest-asyncio", "zipp"}


def test_exlnb_asks_for_the_libraries_and_the_notebook_stack_but_not_what_the_machine_has_or_never_imports():
    names = {name_of(r.name) for r in exlnb_requirements(PYPROJECT.read_text(), names_in(PIP_LIST))}
    assert {"exllamav2", "exllamav3", "llguidance", "ipykernel", "ipywidgets", "papermill", "fastparquet"} <= names
    assert not names & {"torch", "transformers", "playwright", "ruff", "llama-cpp-python", "jupyterlab"}


def test_markers_are_read_for_python_3_12_on_linux_and_the_extras_asked_for():
    assert applies(Requirement('tomli; python_version < "3.11"'), set()) is False
    assert applies(Requirement('pexpect; sys_platform != "win32"'), set()) is True
    assert applies(Requirement('pyzmq; extra == "kernel"'), {"kernel"}) is True
    assert applies(Requirement('pyzmq; extra == "kernel"'), set()) is False
