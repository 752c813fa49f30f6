"""exlnb: one kernel-resident ExLlamaV2 (or CPU) generator for Jupyter research notebooks."""

from exlnb.loadtest import bench
from exlnb.chat import Chat, get_chat
from exlnb.engines.base import EosReason, SamplerSettings, Stage, StreamEvent
from exlnb.generation import Generation
from exlnb.session import Session, get_session
from exlnb.streaming import GenerationResult, JobStream
from exlnb.widgets.cache import show_cache, show_jobs
from exlnb.widgets.stream import agenerate_live, generate_live

__all__ = [
    "Chat",
    "EosReason",
    "Generation",
    "GenerationResult",
    "JobStream",
    "SamplerSettings",
    "Session",
    "Stage",
    "StreamEvent",
    "agenerate_live",
    "bench",
    "generate_live",
    "get_chat",
    "get_session",
    "load_ipython_extension",
    "show_cache",
    "show_jobs",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext exlnb`: registers %exl_load, %%exl_generate, %exl_cache, %exl_jobs and %exl_cancel."""
    from exlnb.magics import ExlnbMagics, await_generate_cells

    magics = ExlnbMagics(ipython)
    ipython.register_magics(magics)
    ipython.events.register("pre_run_cell", magics.remember_cell)
    if getattr(ipython, "kernel", None) is not None and ipython.autoawait:
        ipython.input_transformers_post.append(await_generate_cells)
