"""The benchmark suite runs in quick mode and writes a complete, valid record (no timing assertions)."""

import json
import math

from benchmarks.__main__ import main


def test_quick_benchmarks_write_valid_json_with_raw_samples(cpu_session, tmp_path):
    path = main(["--quick", "--out", str(tmp_path)])
    record = json.loads(path.read_text())

    assert record["environment"]["versions"]["torch"]
    assert record["environment"]["device"].startswith("cpu")
    assert set(record["benchmarks"]) == {"kit", "peer", "context", "concurrency"}
    assert record["skipped"] == {"hardware": "needs the ExLlamaV2 engine on CUDA"}
    kit = record["benchmarks"]["kit"]
    for side in ("session", "raw"):
        stats = kit[side]["decode_tokens_per_s"]
        assert len(stats["samples"]) == record["plan"]["repeats"]
        assert all(math.isfinite(s) and s > 0 for s in stats["samples"])
        assert stats["min"] <= stats["median"] <= stats["max"]
    assert math.isfinite(record["benchmarks"]["peer"]["ratio_decode_engine_over_hf"])
    lengths = [row["context_tokens"] for row in record["benchmarks"]["context"]["rows"]]
    assert lengths == record["plan"]["context_lengths"]
    assert (tmp_path / f"{path.stem}-context.png").stat().st_size > 1000
