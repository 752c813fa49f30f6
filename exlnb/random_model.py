"""A Llama-2-7B-shaped model with random fp16 weights, written on the GPU machine: real 7B timings with
nothing to download or carry. Its text is meaningless; the work per token is a 7B model's.

The benchmarks time decode on it against the memory floor; the context investigation times field report 5's
prompt pass on it, long enough for the GPU to fall behind the host that queues the work.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from exlnb.models import BUNDLED_MODEL, resolve_model

SEVEN_B_SHAPED = "7b-shaped"  # the name notebooks and benchmarks give this model
LLAMA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
WEIGHTS_BYTES = 13_360_000_000  # fp16, with the bundled tokenizer's 49152-token vocabulary
# the weights, a full 4096-token fp16 cache (0.5 MiB a token) and room for exllamav2's scratch buffers
DEVICE_BYTES_NEEDED = WEIGHTS_BYTES + 4 * 2**30


def cannot_make_here() -> str | None:
    """Why the 7B-shaped model cannot be made and loaded on this machine, in a line; None where it can."""
    if not torch.cuda.is_available():
        return "the 7B-shaped model is made and run on CUDA: this machine has none"
    free, _ = torch.cuda.mem_get_info()
    if free < DEVICE_BYTES_NEEDED:
        return (f"the 7B-shaped model needs about {DEVICE_BYTES_NEEDED / 2**30:.0f} GiB of free GPU memory, "
                f"{free / 2**30:.1f} GiB are free")
    return None


def scratch_folder() -> tempfile.TemporaryDirectory:
    """A folder for the random weights: in memory (/dev/shm) where it has room, else the temp directory.

    Suspected cause of the first H100 run's slow 7B samples (191 and 318 ms/token before settling at 15):
    13 GB just written to disk keep the host busy with page-cache writeback while decode, which is bound
    by the host issuing kernels, is timed. tmpfs has no writeback; on disk, `seven_b_shaped` waits for it.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * WEIGHTS_BYTES:
        return tempfile.TemporaryDirectory(prefix="exlnb-7b-", dir=shm)
    return tempfile.TemporaryDirectory(prefix="exlnb-7b-")


@contextmanager
def seven_b_shaped() -> Iterator[tuple[Path, int]]:
    """The 7B-shaped model written to a scratch folder, and the bytes of weights read per token; the folder
    is removed afterwards. The writes are flushed before the folder is handed out, so that no page-cache
    writeback competes with what is timed on the model."""
    with scratch_folder() as tmp:
        folder = Path(tmp)
        weight_bytes = make_random_llama(folder, resolve_model(BUNDLED_MODEL))
        os.sync()
        yield folder, weight_bytes


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_tokenizer(source: Path, folder: Path) -> None:
    """The bundled model's tokenizer and chat template for the random model (transformers 5 keeps the template
    in chat_template.jinja: without it a chat on the 7B-shaped model failed on the GPU, "tokenizer.chat_template
    is not set")."""
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)


def make_random_llama(folder: Path, tokenizer_dir: Path) -> int:
    """Write a 7B-shaped Llama with random fp16 weights; returns the bytes of weights read per token."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tokenizer_dir, folder)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float16", bos_token_id=1, eos_token_id=2,
        hidden_act="silu", **LLAMA_7B,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    h, i = LLAMA_7B["hidden_size"], LLAMA_7B["intermediate_size"]
    layer_shapes = {
        "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (h, h), "self_attn.v_proj.weight": (h, h),
        "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    read_per_token = 0
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(shape) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.float16)
        return (torch.randn(shape, generator=generator, device="cuda", dtype=torch.float16) * 0.02).cpu()

    save_file({"model.embed_tokens.weight": tensor((vocab, h)), "model.norm.weight": tensor((h,)),
               "lm_head.weight": tensor((vocab, h))}, folder / "model-head.safetensors")
    read_per_token += (vocab * h + h) * 2  # the head and final norm; one embedding row is negligible
    for layer in range(LLAMA_7B["num_hidden_layers"]):
        shard = {f"model.layers.{layer}.{k}": tensor(s) for k, s in layer_shapes.items()}
        read_per_token += sum(t.numel() * 2 for t in shard.values())
        save_file(shard, folder / f"model-layer{layer:02d}.safetensors")
    return read_per_token
