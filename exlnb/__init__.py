"""exlnb: one kernel-resident inference engine for Jupyter research notebooks around the ExLlama libraries (the
engines it can load: docs/engines.md)."""

import importlib

from exlnb.chat import Chat, get_chat
from exlnb.engines.base import EosReason, SamplerSettings, Stage, StreamEvent
from exlnb.engines.job_options import JobOptions
from exlnb.generation import Generation
from exlnb.loadtest import bench
from exlnb.near_ties import NoiseFloor
from exlnb.sample_tree import SampleTree
from exlnb.session import LoadOptions, Session, get_session
from exlnb.streaming import GenerationResult, JobStream

__all__ = [
    "BranchTree",
    "Chat",
    "EosReason",
    "Generation",
    "GenerationResult",
    "JobOptions",
    "JobStream",
    "LoadOptions",
    "NoiseFloor",
    "SampleTree",
    "SamplerSettings",
    "Session",
    "Stage",
    "StreamEvent",
    "abench",
    "agenerate_live",
    "atree_live",
    "bench",
    "branch_live",
    "generate_live",
    "get_chat",
    "get_session",
    "load_ipython_extension",
    "show_cache",
    "show_jobs",
    "show_server",
    "show_tree",
    "tree_live",
]
__version__ = "0.1.0"

# The widgets load anywidget and traitlets: imported on first use, so a script that never shows one
# does not pay for them.
_WIDGETS = {
    "show_cache": "exlnb.widgets.cache",
    "show_jobs": "exlnb.widgets.cache",
    "show_server": "exlnb.widgets.server",
    "abench": "exlnb.widgets.loadtest",
    "agenerate_live": "exlnb.widgets.stream",
    "BranchTree": "exlnb.widgets.branches",
    "branch_live": "exlnb.widgets.stream",
    "generate_live": "exlnb.widgets.stream",
    "show_tree": "exlnb.widgets.tree",
    "tree_live": "exlnb.widgets.tree",
    "atree_live": "exlnb.widgets.tree",
}


def __getattr__(name: str):
    if name not in _WIDGETS:
        raise AttributeError(f"module 'exlnb' has no attribute {name!r}")
    return getattr(importlib.import_module(_WIDGETS[name]), name)


def load_ipython_extension(ipython) -> None:
    """`%load_ext exlnb`: registers %exl_load, %%exl_generate, %exl_branch, %%exl_tree, %exl_cache, %exl_jobs,
    %exl_cancel, %exl_bench, %exl_quantize, %exl_divergence and %exl_noise_floor."""
    from exlnb.magics import ExlnbMagics, await_magic_cells
    from exlnb.quality_magics import QualityMagics

    magics = ExlnbMagics(ipython)
    ipython.register_magics(magics)
    ipython.register_magics(QualityMagics(ipython))
    ipython.events.register("pre_run_cell", magics.remember_cell)
    if getattr(ipython, "kernel", None) is not None and ipython.autoawait:
        ipython.input_transformers_post.append(await_magic_cells)
