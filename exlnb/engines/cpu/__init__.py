"""The CPU engine: paged KV cache, continuous batching and exllamav2's sampling, on PyTorch CPU."""

from exlnb.engines.cpu.engine import CpuEngine

__all__ = ["CpuEngine"]
