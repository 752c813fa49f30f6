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
# Llama-2-70B's widths (grouped-query attention, 8 KV heads); the layer count is chosen to reach a size
LLAMA_70B_LAYER = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)
BUNDLED_VOCAB = 49_152  # the bundled model's vocabulary (its config.json), which the random models take over
TOKENIZER_DIR_VARIABLE = "EXLNB_TOKENIZER_DIR"


def layer_bytes(shape: dict) -> int:
    """fp16 bytes of one decoder layer of a Llama shape: the bytes each token reads from it at decode."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return 2 * (2 * h * h + 2 * kv * h + 3 * i * h + 2 * h)


def head_bytes(shape: dict, vocab: int) -> int:
    """fp16 bytes of the embedding, the final norm and the (untied) output head."""
    return 2 * (2 * vocab * shape["hidden_size"] + shape["hidden_size"])


def weights_bytes(shape: dict, vocab: int) -> int:
    """fp16 bytes of every weight of a Llama of `shape`: what its folder holds and a device must load."""
    return head_bytes(shape, vocab) + shape["num_hidden_layers"] * layer_bytes(shape)


WEIGHTS_BYTES = weights_bytes(LLAMA_7B, BUNDLED_VOCAB)  # the 7B-shaped model: 13.76 GB
# the weights, a full 4096-token fp16 cache (0.5 MiB a token) and room for exllamav2's scratch buffers
DEVICE_BYTES_NEEDED = WEIGHTS_BYTES + 4 * 2**30


def shape_larger_than(device_bytes: int, ratio: float, vocab: int) -> dict:
    """A Llama-2-70B-wide shape with just enough layers that its weights exceed `ratio` times `device_bytes`:
    a model that cannot load on one card, for the layer split and tensor parallelism."""
    needed = ratio * device_bytes - head_bytes(LLAMA_70B_LAYER, vocab)
    layers = max(1, -int(-needed // layer_bytes(LLAMA_70B_LAYER)))
    return dict(LLAMA_70B_LAYER, num_hidden_layers=layers)


def tokenizer_folder() -> Path:
    """Where the random models take their tokenizer, chat template and vocabulary size from: the bundled
    model's folder, or the folder that EXLNB_TOKENIZER_DIR names (its config.json and tokenizer files alone
    serve, on a machine that has the tokenizer but not the bundled GGUF)."""
    named = os.environ.get(TOKENIZER_DIR_VARIABLE)
    return Path(named) if named else resolve_model(BUNDLED_MODEL)


def cannot_make_here() -> str | None:
    """Why the 7B-shaped model cannot be made and loaded on this machine, in a line; None where it can."""
    if not torch.cuda.is_available():
        return "the 7B-shaped model is made and run on CUDA: this machine has none"
    free, _ = torch.cuda.mem_get_info()
    if free < DEVICE_BYTES_NEEDED:
        return (
            f"the 7B-shaped model needs about {DEVICE_BYTES_NEEDED / 2**30:.0f} GiB of free GPU memory, "
            f"{free / 2**30:.1f} GiB are free"
        )
    return None


def scratch_folder(size: int = WEIGHTS_BYTES) -> tempfile.TemporaryDirectory:
    """A folder for the random weights: in memory (/dev/shm) where it has room, else the temp directory.

    Suspected cause of the first H100 run's slow 7B samples (191 and 318 ms/token before settling at 15):
    13 GB just written to disk keep the host busy with page-cache writeback while decode, which is bound
    by the host issuing kernels, is timed. tmpfs has no writeback; on disk, `random_llama` waits for it.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * size:
        return tempfile.TemporaryDirectory(prefix="exlnb-random-", dir=shm)
    return tempfile.TemporaryDirectory(prefix="exlnb-random-")


@contextmanager
def seven_b_shaped() -> Iterator[tuple[Path, int]]:
    """The 7B-shaped model written to a scratch folder, and the bytes of weights read per token; the folder
    is removed afterwards."""
    with random_llama(LLAMA_7B) as made:
        yield made


@contextmanager
def random_llama(shape: dict, *, distinct_layers: bool = True) -> Iterator[tuple[Path, int]]:
    """A Llama of `shape` with random fp16 weights in a scratch folder, and the bytes of weights read per token;
    the folder is removed afterwards. The writes are flushed before the folder is handed out, so that no
    page-cache writeback competes with what is timed on the model."""
    source = tokenizer_folder()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    with scratch_folder(weights_bytes(shape, vocab)) as tmp:
        folder = Path(tmp)
        weight_bytes = make_random_llama(folder, source, shape, distinct_layers=distinct_layers)
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


def make_random_llama(
    folder: Path, tokenizer_dir: Path, shape: dict = LLAMA_7B, *, distinct_layers: bool = True
) -> int:
    """Write a Llama of `shape` with random fp16 weights; returns the bytes of weights read per token.

    `distinct_layers=False` writes one layer's random weights into every layer: the same work per token,
    written in a fraction of the time, for a model of a hundred GB or more whose outputs nobody reads."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tokenizer_dir, folder)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float16",
        bos_token_id=1,
        eos_token_id=2,
        hidden_act="silu",
        **shape,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer_shapes = {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CUDA draws 13 GB of weights in seconds
    generator = torch.Generator(device=device).manual_seed(0)

    def tensor(dims) -> torch.Tensor:
        if len(dims) == 1:
            return torch.ones(dims, dtype=torch.float16)
        return (torch.randn(dims, generator=generator, device=device, dtype=torch.float16) * 0.02).cpu()

    weight_map: dict[str, str] = {}

    def save(shard: dict[str, torch.Tensor], name: str) -> None:
        save_file(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))

    save(
        {
            "model.embed_tokens.weight": tensor((vocab, h)),
            "model.norm.weight": tensor((h,)),
            "lm_head.weight": tensor((vocab, h)),
        },
        "model-head.safetensors",
    )
    shared = None if distinct_layers else {k: tensor(dims) for k, dims in layer_shapes.items()}
    for layer in range(shape["num_hidden_layers"]):
        weights = shared or {k: tensor(dims) for k, dims in layer_shapes.items()}
        save({f"model.layers.{layer}.{k}": t for k, t in weights.items()}, f"model-layer{layer:03d}.safetensors")
    # the index a sharded checkpoint carries: without it transformers looks for model.safetensors and stops
    total = weights_bytes(shape, vocab)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total - 2 * vocab * h  # every weight but the embedding, of which decode reads one row per token
