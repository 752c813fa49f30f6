"""The paged KV cache: page bookkeeping, and the paged forward pass against transformers' own."""

from __future__ import annotations

import pytest
import torch

from exlnb.engines.cpu.pages import PagePool, prefix_hashes
from exlnb.engines.cpu.runner import PagedRunner, SequenceChunk


def test_reservation_takes_pages_for_prompt_and_new_tokens():
    pool = PagePool(num_pages=8, page_size=4)
    r = pool.reserve(job_id=1, prompt_ids=list(range(6)), total_tokens=10)
    assert len(r.page_table) == 3 and r.cached_tokens == 0
    assert pool.free_count == 5
    assert all(pool.pages[i].owners == {1} for i in r.page_table)


def test_reservation_fails_without_enough_free_pages_and_changes_nothing():
    pool = PagePool(num_pages=2, page_size=4)
    assert pool.reserve(1, [1, 2, 3], total_tokens=12) is None
    assert pool.free_count == 2 and all(p.ref_count == 0 for p in pool.pages)


def test_shared_prefix_pages_are_referenced_not_copied():
    pool = PagePool(num_pages=8, page_size=4)
    prompt = list(range(10))
    first = pool.reserve(1, prompt, total_tokens=12)
    pool.publish_prefix(first.page_table, first.prefix_hashes, computed_tokens=10)
    second = pool.reserve(2, prompt, total_tokens=12)

    assert second.cached_tokens == 8
    assert second.page_table[:2] == first.page_table[:2]
    assert pool.pages[first.page_table[0]].ref_count == 2
    assert second.page_table[2] != first.page_table[2]


def test_the_last_prompt_token_is_always_recomputed():
    pool = PagePool(num_pages=8, page_size=4)
    prompt = list(range(8))  # exactly two pages
    first = pool.reserve(1, prompt, total_tokens=9)
    pool.publish_prefix(first.page_table, first.prefix_hashes, computed_tokens=8)
    assert pool.reserve(2, prompt, total_tokens=9).cached_tokens == 4


def test_released_prefix_pages_stay_findable_until_reused():
    pool = PagePool(num_pages=4, page_size=4)
    prompt = list(range(9))
    first = pool.reserve(1, prompt, total_tokens=10)
    pool.publish_prefix(first.page_table, first.prefix_hashes, computed_tokens=9)
    pool.release(1, first.page_table)
    assert pool.free_count == 4
    assert pool.reserve(2, prompt, total_tokens=10).cached_tokens == 8


def test_different_prefixes_do_not_match_even_with_equal_later_pages():
    a = prefix_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = prefix_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]


@pytest.fixture(scope="module")
def hf_model(cpu_session):
    from transformers import AutoModelForCausalLM

    from exlnb.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    return model.eval()


def test_paged_forward_matches_transformers_logits(hf_model):
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (1, 300))
    with torch.inference_mode():
        reference = hf_model(ids).logits[0]

    runner = PagedRunner(hf_model, num_pages=6, page_size=256)
    table = (4, 1)  # scattered, out-of-order pages
    prefill = runner.forward([SequenceChunk(tuple(ids[0, :200].tolist()), 0, table)])
    chunk = runner.forward([SequenceChunk(tuple(ids[0, 200:299].tolist()), 200, table)])
    decode = runner.forward([SequenceChunk((int(ids[0, 299]),), 299, table)])

    for got, position in ((prefill[0], 199), (chunk[0], 298), (decode[0], 299)):
        torch.testing.assert_close(got, reference[position], atol=2e-3, rtol=1e-3)


def test_batched_sequences_do_not_see_each_other(hf_model):
    torch.manual_seed(1)
    a, b = torch.randint(100, 40000, (2, 40))
    runner = PagedRunner(hf_model, num_pages=4, page_size=256)
    batched = runner.forward([SequenceChunk(tuple(a.tolist()), 0, (0,)), SequenceChunk(tuple(b.tolist()), 0, (3,))])
    with torch.inference_mode():
        alone = hf_model(b[None]).logits[0, -1]
    torch.testing.assert_close(batched[1], alone, atol=2e-3, rtol=1e-3)
