"""One batched forward pass of a transformers Llama-family model over a paged KV cache.

The model's own modules (embedding, norms, projections, rotary embedding, MLP, head) do the arithmetic;
only attention is ours, because it must read keys and values through each job's page table. Tokens of
all jobs in a step, prompt chunks and single decode tokens alike, go through the projections as one
matrix; attention then runs per job over that job's pages (bottom-right causal, grouped-query heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# Architectures whose decoder layer is exactly: norm, q/k/v/o attention with rotary, norm, MLP.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one job for this step, placed at positions [start, start + len(token_ids))."""

    token_ids: tuple[int, ...]
    start: int
    page_table: tuple[int, ...]


class PagedRunner:
    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the CPU engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; this one is "
                f"{config.model_type!r}. Use the ExLlamaV2 engine for it."
            )
        self.model = model
        self.page_size = page_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        slots = num_pages * page_size
        shape = (config.num_hidden_layers, slots, self.num_kv_heads, self.head_dim)
        # allocated, not zeroed: attention reads only positions a job (or the writer of a page it shares) has
        # written, and zeroing the default 8192-token cache (377 MB) was a tenth of a load
        self.keys = torch.empty(shape, dtype=model.dtype)
        self.values = torch.empty(shape, dtype=model.dtype)

    def slots(self, page_table: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        positions = torch.arange(start, stop)
        pages = torch.tensor(page_table, dtype=torch.long)[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    @torch.inference_mode()
    def forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Write the chunks' keys and values into the cache; return logits at each chunk's last token."""
        lengths = [len(c.token_ids) for c in chunks]
        tokens = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(chunks, lengths)])
        write_slots = torch.cat([self.slots(c.page_table, c.start, c.start + n) for c, n in zip(chunks, lengths)])
        read_slots = [self.slots(c.page_table, 0, c.start + n) for c, n in zip(chunks, lengths)]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)

        inner = self.model.model
        hidden = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(hidden[None], positions[None])
        cos, sin = cos[0], sin[0]
        for layer_index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(-1, self.num_heads, self.head_dim)
            k = attention.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            v = attention.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            layer_keys, layer_values = self.keys[layer_index], self.values[layer_index]
            layer_keys.index_copy_(0, write_slots, k)
            layer_values.index_copy_(0, write_slots, v)
            out = torch.empty_like(q)
            for chunk, n, lo, slots in zip(chunks, lengths, offsets, read_slots):
                # index_select, not advanced indexing: 4-8x faster a gather at 8000 tokens of context, where the
                # gather was 40% of a decode step (benchmarks/README.md)
                keys, values = layer_keys.index_select(0, slots), layer_values.index_select(0, slots)
                out[lo : lo + n] = self._attend(q[lo : lo + n], keys, values, chunk.start)
            hidden = hidden + attention.o_proj(out.view(-1, self.num_heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = torch.tensor([lo + n - 1 for lo, n in zip(offsets, lengths)])
        return self.model.lm_head(inner.norm(hidden[last])).float()

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Attention of n new queries (positions start..start+n-1) over all start+n cached keys."""
        n = q.shape[0]
        q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if n == 1:
            mask, causal = None, False
        elif start == 0:
            mask, causal = None, True
        else:  # bottom-right causal: query i sees keys up to start + i
            mask = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return out[0].transpose(0, 1)
