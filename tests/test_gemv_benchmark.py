"""The GEMV suite on the CPU: every variant that runs gives the separate products' answers, fused and separate
read the same weights, and what cannot run here says why (its timings are the GPU's business)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import gemv


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemv")
    gemv.main(["--shape", "tiny", "--samples", "2", "--repeats", "2", "--out", str(out)])
    (path,) = out.glob("gemv-tiny-*.json")
    return json.loads(path.read_text())


def test_every_variant_that_ran_matches_the_separate_products(tiny_run):
    ran = [
        (batch, name, row["eager"])
        for batch, rows in tiny_run["batches"].items()
        for name, row in rows.items()
        if "eager" in row
    ]
    assert {name for _, name, _ in ran} >= {"separate", "fused", "fused_transposed", "stacked"}
    assert set(tiny_run["batches"]) == {"1", "8"}
    for batch, name, eager in ran:
        assert math.isfinite(eager["max_error"]) and eager["max_error"] < 1e-2, (batch, name)
        assert eager["correct"]
        assert eager["ms_per_layer"] > 0 and eager["bandwidth_bytes_per_s"] > 0


def test_fused_and_separate_read_the_same_weights(tiny_run):
    for rows in tiny_run["batches"].values():
        fp16_weights = 2 * (4 * 256 * 256 + 3 * 704 * 256)
        assert rows["fused"]["eager"]["bytes"] == rows["separate"]["eager"]["bytes"] == fp16_weights
        assert rows["stacked"]["eager"]["bytes"] == fp16_weights
        assert (rows["separate"]["products"], rows["fused"]["products"], rows["stacked"]["products"]) == (7, 4, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the Triton variants run")
def test_what_needs_cuda_says_why_it_was_left_out(tiny_run):
    for rows in tiny_run["batches"].values():
        for name in ("triton_splitk_fused", "triton_splitk_separate", "cublaslt"):
            assert set(rows[name]) == {"why"} and "no CUDA" in rows[name]["why"]
        assert "no CUDA" in rows["separate"]["graphed"]["why"]
    assert tiny_run["device"].startswith("cpu")
    assert tiny_run["best"]["1"]["eager"]["variant"] in tiny_run["batches"]["1"]
