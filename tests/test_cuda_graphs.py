"""Two sessions' engine threads capturing on one card at once (engines/cuda_graphs.py): each model's graphs hold
its own kernels only. The capture stream is one per card for every model in the process; a stream being captured
records what any thread enqueues on it, so without the capture lock one thread's warm-up kernels could land in
the other's graph (and run again at each of its replays) or a capture fail. CUDA only (`-m gpu`)."""

from __future__ import annotations

import threading

import pytest
import torch

from exlnb.engines.cuda_graphs import WARMUP_RUNS, StepGraphs

KEYS = 24  # graphs each thread captures, each after its warm-up runs


@pytest.mark.gpu
def test_two_threads_capturing_on_one_card_keep_each_graph_to_its_own_kernels():
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    device = torch.device("cuda", 0)
    owners = [
        {
            "graphs": StepGraphs(device),
            "x": torch.randn(1 << 20, device=device),
            "runs": torch.zeros((), dtype=torch.int64, device=device),  # every run of every step, counted on the card
        }
        for _ in range(2)
    ]
    start, errors = threading.Barrier(2), []

    def step_of(owner: dict, key: int):
        def run() -> torch.Tensor:
            owner["runs"].add_(1)
            return owner["x"] * (key + 1)

        return lambda: run

    def capture_all(owner: dict) -> None:
        try:
            with torch.cuda.device(device):
                start.wait(timeout=60)
                for key in range(KEYS):
                    owner["graphs"].replay(key, step_of(owner, key), shape=f"key {key}")
                torch.cuda.synchronize()
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)

    threads = [threading.Thread(target=capture_all, args=(owner,)) for owner in owners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for owner in owners:  # the warm-up runs and the replay after each capture, each counted once
        assert int(owner["runs"]) == (WARMUP_RUNS + 1) * KEYS

    for owner, other in ((owners[0], owners[1]), (owners[1], owners[0])):
        mine, theirs = int(owner["runs"]), int(other["runs"])
        for key in range(KEYS):
            out = owner["graphs"].replay(key, step_of(owner, key), shape=f"key {key}")
            torch.cuda.synchronize()
            assert torch.equal(out, owner["x"] * (key + 1))
        assert len(owner["graphs"]) == KEYS  # replayed, not captured again
        assert int(owner["runs"]) == mine + KEYS  # each replay runs its own step once
        assert int(other["runs"]) == theirs  # and none of the other thread's kernels
