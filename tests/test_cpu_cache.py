"""The paged KV cache: page bookkeeping, and the paged forward pass against transformers' own."""

from __future__ import annotations

import pytest
import torch

from exlnb.engines.cpu.pages import PagePool, prefix_hashes
from exlnb.engines.cpu.runner import PagedRunner, SequenceChunk
from exlnb.engines.job_options import JobOptions


def test_reservation_takes_pages_for_prompt_and_new_tokens():
    pool = PagePool(num_pages=8, page_size=4)
    r = pool.reserve(job_id=1, prompt_ids=list(range(6)), total_tokens=10)
    assert len(r.page_table) == 3 and r.shared_pages == 0
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
    pool.mark_filled(first.page_table, 10)
    second = pool.reserve(2, prompt, total_tokens=12)

    assert second.shared_pages == 2
    assert pool.prefill_span(2, second, 0) == (8, None)
    assert second.page_table[:2] == first.page_table[:2]
    assert pool.pages[first.page_table[0]].ref_count == 2
    assert second.page_table[2] != first.page_table[2]


def test_the_last_prompt_token_is_always_recomputed():
    pool = PagePool(num_pages=8, page_size=4)
    prompt = list(range(8))  # exactly two pages
    first = pool.reserve(1, prompt, total_tokens=9)
    pool.mark_filled(first.page_table, 8)
    assert pool.reserve(2, prompt, total_tokens=9).shared_pages == 1


def test_released_prefix_pages_stay_findable_until_reused():
    pool = PagePool(num_pages=4, page_size=4)
    prompt = list(range(9))
    first = pool.reserve(1, prompt, total_tokens=10)
    pool.mark_filled(first.page_table, 9)
    pool.release(1, first.page_table)
    assert pool.free_count == 4
    assert pool.reserve(2, prompt, total_tokens=10).shared_pages == 2


def test_jobs_reserved_together_share_prompt_pages_before_they_are_computed():
    pool = PagePool(num_pages=8, page_size=4)
    prompt = list(range(10))
    first = pool.reserve(1, prompt, total_tokens=12)
    second = pool.reserve(2, prompt, total_tokens=12)

    assert second.page_table[:2] == first.page_table[:2]
    assert pool.pages[first.page_table[0]].ref_count == 2
    assert pool.prefill_span(1, first, 0) == (0, None)  # the first job writes the shared pages
    assert pool.prefill_span(2, second, 0) == (0, 0)  # the second waits for them
    pool.mark_filled(first.page_table, 4)
    assert pool.prefill_span(2, second, 0) == (4, 4)  # one page done, the next still being written
    pool.mark_filled(first.page_table, 8)
    assert pool.prefill_span(2, second, 0) == (8, None)


def test_a_shared_page_whose_writer_leaves_passes_to_a_job_that_still_needs_it():
    pool = PagePool(num_pages=8, page_size=4)
    prompt = list(range(10))
    first = pool.reserve(1, prompt, total_tokens=12)
    second = pool.reserve(2, prompt, total_tokens=12)
    pool.mark_filled(first.page_table, 6)  # cancelled halfway through the second page
    pool.release(1, first.page_table)

    assert pool.prefill_span(2, second, 0) == (4, None)  # the first page is kept; the second job writes on


def test_a_page_its_writer_left_unfinished_is_not_found_again():
    pool = PagePool(num_pages=4, page_size=4)
    prompt = list(range(10))
    first = pool.reserve(1, prompt, total_tokens=10)
    pool.mark_filled(first.page_table, 6)
    pool.release(1, first.page_table)
    assert pool.reserve(2, prompt, total_tokens=10).shared_pages == 1


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


def test_samples_started_together_compute_the_shared_prompt_once(cpu_session, greedy):
    """`--n` samples: four greedy jobs of one 600-token prompt, queued in one engine command."""
    ids = tuple(torch.randint(100, 40000, (600,), generator=torch.Generator().manual_seed(2)).tolist())
    spec = cpu_session.spec_for(ids, JobOptions(max_new_tokens=3, sampler=greedy, stop_at_eos=False))

    def run_together(engine):
        job_ids = [engine.enqueue(spec) for _ in range(4)]
        events = engine.step()
        first_view = engine.cache_view()
        while engine.has_work():
            events += engine.step()
        last = {e.job_id: e for e in events if e.eos}
        return (
            first_view,
            [last[j] for j in job_ids],
            [[t for e in events if e.job_id == j for t in e.token_ids] for j in job_ids],
        )

    view, ends, outputs = cpu_session.run_on_engine(run_together)
    solo = cpu_session.complete(ids, max_new_tokens=3, sampler=greedy, stop_at_eos=False)

    assert sorted(p.ref_count for p in view.pages if p.shared) == [4, 4]  # both full prompt pages, from the start
    assert sorted(e.cached_tokens for e in ends) == [0, 512, 512, 512]
    assert sum(e.computed_prompt_tokens for e in ends) == 600 + 3 * 88
    assert all(tuple(out) == tuple(solo.token_ids) for out in outputs)
