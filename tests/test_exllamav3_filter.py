"""exlnb's wrapper of exllamav3's llguidance filter, without exllamav3 (its filter is stood in for by one that
masks and refuses as llguidance does): errors are kept for the engine, a stopped matcher never ends a job as
complete after an error, and a token drawn outside the mask is named as the sampler's fault."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import imported_over_stand_ins

ALLOWED = (5, 40)


class StandInLLGuidanceFilter:
    """Allows ALLOWED; accepting anything else raises as exllamav3's filter does on a matcher error."""

    def __init__(self, *args, **kwargs) -> None:
        self._bitmask_torch = torch.zeros((1, 2), dtype=torch.int32)
        for token in ALLOWED:
            self._bitmask_torch[0, token >> 5] |= 1 << (token & 31)
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> None:
        if token not in ALLOWED:
            raise RuntimeError(f"llguidance matcher error: token {token} doesn't satisfy the grammar")
        self.accepted.append(token)

    def get_next_logit_mask(self) -> torch.Tensor:
        return self._bitmask_torch

    def is_completed(self) -> bool:
        return True  # a stopped matcher: after one token here, and after any error in llguidance

    def reset(self) -> None:
        self.accepted.clear()


@pytest.fixture
def kept_error_filter(monkeypatch):
    with imported_over_stand_ins(
        monkeypatch,
        "exlnb.engines.exllamav3.filter",
        "exllamav3.generator.filter",
        LLGuidanceFilter=StandInLLGuidanceFilter,
    ) as module:
        yield module.KeptErrorFilter()


def test_a_token_inside_the_mask_is_accepted(kept_error_filter):
    kept_error_filter.get_next_logit_mask()
    kept_error_filter.accept_token(40)
    assert kept_error_filter.error is None and kept_error_filter.accepted == [40] and kept_error_filter.is_completed()


def test_a_token_drawn_outside_the_mask_is_the_samplers_fault_and_ends_nothing_as_complete(kept_error_filter):
    kept_error_filter.get_next_logit_mask()
    kept_error_filter.accept_token(42)

    assert "exllamav3's sampler drew token 42, outside the 2 tokens" in str(kept_error_filter.error)
    assert kept_error_filter.accepted == [] and not kept_error_filter.is_completed()
    assert (kept_error_filter.get_next_logit_mask() == -1).all()  # no restriction for the step left


def test_an_error_inside_the_library_filter_is_kept_not_raised(kept_error_filter):
    kept_error_filter.accept_token(7)  # no mask given yet: the library's own check refuses it
    assert "llguidance matcher error" in str(kept_error_filter.error) and not kept_error_filter.is_completed()
