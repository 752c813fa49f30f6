"""exlnb: one kernel-resident ExLlamaV2 (or CPU) generator for Jupyter research notebooks."""

from exlnb.engines.base import EosReason, SamplerSettings, Stage, StreamEvent
from exlnb.session import Session, get_session
from exlnb.streaming import GenerationResult, JobStream

__all__ = [
    "EosReason",
    "GenerationResult",
    "JobStream",
    "SamplerSettings",
    "Session",
    "Stage",
    "StreamEvent",
    "get_session",
]
__version__ = "0.1.0"
