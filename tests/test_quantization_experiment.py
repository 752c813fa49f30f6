"""The quantization investigation: its measures, and on a CPU machine a clean stop that says why."""

from __future__ import annotations

import json

import pytest

from exlnb.experiments import quantization
from exlnb.experiments.quantization import NEEDS_CUDA, agreement


@pytest.mark.parametrize(
    "tokens, reference, expected",
    [
        ((1, 2, 3, 4), (1, 2, 3, 4), 1.0),
        ((1, 2, 9, 4), (1, 2, 3, 4), 0.5),
        ((7,), (1, 2), 0.0),
        ((1, 2), (1, 2, 3, 4), 0.5),
    ],
)
def test_agreement_is_the_share_of_fp16_tokens_before_the_first_difference(tokens, reference, expected):
    assert agreement(tokens, reference) == expected


def test_without_cuda_it_says_so_and_still_writes_its_files(cpu_session, tmp_path):
    result = quantization.run(cpu_session, bits=(4.0,))
    assert result.findings == [NEEDS_CUDA] and result.effects == []

    written = {path.name for path in result.save(tmp_path, quantization.plot(result))}

    assert written == {"quantization-conditions.csv", "quantization.json"}  # no figure of text alone
    summary = json.loads((tmp_path / "quantization.json").read_text())
    assert summary["findings"] == [NEEDS_CUDA] and summary["figure"] is None


def test_the_gpu_summary_compares_each_quantized_model_with_fp16(tmp_path):
    import pandas as pd

    labels = [
        ("fp16", "fp16", 16.0, "exllamav2"),
        ("EXL3 4 bpw", "exl3", 4.0, "exllamav3"),
        ("EXL2 4 bpw", "exl2", 4.0, "exllamav2"),
    ]
    conditions = pd.DataFrame(
        [
            {
                "condition": c,
                "format": f,
                "bits": b,
                "engine": e,
                "perplexity": 10.0 + b / 16,
                "kl_mean": 1 / b - 1 / 16,
                "kl_median": 0.5 / b - 0.5 / 16,
                "kl_p90": 2 / b - 2 / 16,
                "top1_agreement": 1 - 1 / b + 1 / 16,
                "weights_gib": b / 64,
                "device_memory_gib": 0.3,
            }
            for c, f, b, e in labels
        ]
    )
    answers = pd.DataFrame(
        [
            {
                "condition": c,
                "format": f,
                "bits": b,
                "question_id": q,
                "correct": q % 2 == 0,
                "agreement": 1.0 if f == "fp16" else 0.5,
                "answer": "",
            }
            for c, f, b, _ in labels
            for q in range(6)
        ]
    )
    decode = pd.DataFrame(
        [
            {
                "condition": c,
                "format": f,
                "bits": b,
                "repeat": r,
                "decode_tokens_per_s": 100.0 * (2 if f != "fp16" else 1) + r,
            }
            for c, f, b, _ in labels
            for r in range(3)
        ]
    )
    failed = pd.DataFrame(
        [{"condition": "EXL3 3 bpw", "format": "exl3", "bits": 3.0, "error": "RuntimeError: no kernel"}]
    )
    tables = {"conditions": conditions, "answers": answers, "decode": decode, "failed": failed}
    result = quantization._summarise(tables, {}, {})

    speed = next(e for e in result.effects if e.name == "decode tokens/s, EXL3 4 bpw")
    assert speed.symptom_label == "fp16" and speed.ratio.value == pytest.approx(101 / 201)
    assert result.findings[0].startswith("fp16 (exllamav2 engine): perplexity 11.00, accuracy 50%")
    assert "EXL3 (exllamav3 engine): 4 bpw: agreement 50%" in result.findings[2]
    assert "KL from fp16 0.1875 (median 0.09375), top-1 agreement 81%" in result.findings[2]
    assert result.findings[-1] == "EXL3 3 bpw: not measured, it failed: RuntimeError: no kernel"
    assert result.values["failed"] == [
        {"condition": "EXL3 3 bpw", "format": "exl3", "bits": 3.0, "error": "RuntimeError: no kernel"}
    ]
    assert quantization.plot(result) is not None
