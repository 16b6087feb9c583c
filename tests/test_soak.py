"""scripts/soak.py on the CPU at a tiny size (a 2-layer CLIP vision tower 64 wide, 17
tokens; 3 AdamW steps per run, float32): the runs, their record and summary. The
full soak runs on the GPU (tests/test_gpu_soak.py, and the script itself)."""
import json

import pytest

pytest.importorskip("transformers")

from scripts import soak  # noqa: E402


def test_tiny_soak_records_every_run(tmp_path):
    report = soak.main(["--tiny", "--layers", "2", "--steps", "3", "--batch", "2",
                        "--spread-seeds", "2", "--settings", "float32", "--out",
                        str(tmp_path)])
    result = report["results"]["float32"]
    runs, summary = result["runs"], result["summary"]
    assert set(runs) == {"swapped", "swapped again", "stock", "stock again", "stock, seed 1",
                         "stock, seed 2"}
    for run in runs.values():
        assert len(run["losses"]) == 3 and run["non_finite_steps"] == []
    # the CPU path computes in float64 and rounds: the swapped forward is the stock
    # one's to float32 rounding, and repeats bit for bit
    swapped, stock = runs["swapped"]["losses"], runs["stock"]["losses"]
    assert abs(swapped[0] - stock[0]) <= 1e-5 * stock[0], (swapped, stock)
    assert summary["bitwise_reproducible"]
    assert 0 <= summary["swapped_vs_stock"] < summary["run_to_run_spread"], summary
    # the spread is the farther of the two other seeds; stock on the CPU repeats exactly
    assert summary["run_to_run_spread"] == max(summary["spread_per_seed"].values()) > 0
    assert summary["stock_again_vs_stock"] == 0.0
    assert json.loads((tmp_path / "soak.json").read_text())["results"]["float32"]
