"""The ExLlamaV3 engine: exllamav3's generator, its sampler steps, its filter, and the fixes exlnb applies to it.

Nothing here imports exllamav3 at import time: the library JIT-builds its extension when first imported."""
