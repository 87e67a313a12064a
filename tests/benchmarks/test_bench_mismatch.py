"""Smoke run of benchmarks/bench_mismatch.py on a tiny model (its numbers are not checked,
except that the bf16 copy shows mismatch and the fp32 engine does not)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks folder is not an installed package
    sys.path.insert(0, str(ROOT))


def test_mismatch_benchmark_writes_results(tmp_path):
    from benchmarks import bench_mismatch

    data = bench_mismatch.main(["--model", "tiny:llama", "--reps", "1", "--prompts", "2",
                                "--group-size", "2", "--max-new-tokens", "4", "--sync-reps",
                                "1", "--out", str(tmp_path)])
    arms = data["arms"]
    assert arms["bf16"]["mismatch/token_log_ratio_abs_max"] > 1e-4
    assert arms["fp32"]["mismatch/token_log_ratio_abs_max"] < 1e-5
    assert json.loads((tmp_path / "mismatch_tiny-llama.json").read_text())["arms"]
