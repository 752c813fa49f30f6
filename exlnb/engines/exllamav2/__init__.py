"""The ExLlamaV2 engine: exllamav2's dynamic generator, its filter, exlnb's paged attention and CUDA-graph decode.

Nothing here imports exllamav2 at import time: the library JIT-builds its extension when first imported."""
