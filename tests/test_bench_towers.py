"""scripts/bench_towers.py on the CPU at a tiny size (a 1-layer, 65-token, 128-wide HF CLIP
tower, batch 1-2): each suite tested here runs, writes its JSON, and what it records is
what it measured: medians inside their spreads, ratios of the medians it printed, 0 graph
breaks for the stock and swapped towers (the swapped float32 tower runs our operators
inside torch.compile), and under torch.use_deterministic_algorithms(True) every model's
step repeats bit for bit. Needs transformers (skipped without it, as tests/test_hf.py);
the GPU runs of the same suites are the script's docstring's commands. The integrations,
head_dims and restart suites share run_towers / train_step with these and are left to
the GPU run (their compiles of four or more towers would take minutes here)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def run_suite(out, suite, *extra):
    """Run one suite in a fresh process (the deterministic suite sets process-wide
    state: the flag, CUBLAS_WORKSPACE_CONFIG); return its JSON record and stdout."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_towers.py"), "--suite", suite,
         "--out", str(out), "--layers", "1", "--rounds", "1", "--repeats", "2",
         "--no-record", *extra],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / f"{suite}.json").read_text()), run.stdout


def check_row(row):
    """A row's figures are positive and finite, its median inside its spread (which
    model was faster is not asserted: on a shared machine it is noise)."""
    assert all(math.isfinite(row[k]) for k in ("min_ms", "median_ms", "max_ms",
                                               "first_step_s")), row
    assert 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"], row
    assert row["first_step_s"] > 0, row


def test_float32_suite_compiles_both_towers_without_graph_breaks(tmp_path):
    record, stdout = run_suite(tmp_path, "float32", "--float32-precisions", "high",
                               "--batch-sizes", "2")
    (result,) = record["results"]
    rows = result["rows"]
    assert set(rows) == {"stock", "swapped", "compiled stock", "compiled swapped"}
    for name, row in rows.items():
        check_row(row)
        assert row["graph_breaks"] == 0, name
    assert result["ratios"]["eager"] == pytest.approx(
        rows["stock"]["median_ms"] / rows["swapped"]["median_ms"])
    assert result["ratios"]["compiled"] == pytest.approx(
        rows["compiled stock"]["median_ms"] / rows["compiled swapped"]["median_ms"])
    # the closing table is printed last
    assert stdout.strip().splitlines()[-1].startswith("| hf clip | float32 high | 2 |")


def test_deterministic_suite_repeats_every_step_bitwise_under_the_flag(tmp_path):
    """Under autocast, the setting with the extra model (precision "medium"): the float32
    setting runs the same code with one model fewer."""
    record, _ = run_suite(tmp_path, "deterministic", "--settings", "autocast",
                          "--batch-sizes", "2")
    assert record["environment"]["cublas_workspace_config"] == ":4096:8"
    settings = {r["setting"]: r for r in record["results"]}
    assert set(settings) == {"autocast"}
    assert set(settings["autocast"]["modes"]["flag on"]) == {"stock", "swapped",
                                                             "swapped medium"}
    for result in settings.values():
        for mode, rows in result["modes"].items():
            for name, row in rows.items():
                check_row(row)
                assert row["bitwise_repeat"] and row["gradients_differing"] == 0, \
                    (result["setting"], mode, name)


@pytest.fixture(scope="module")
def host_suite(tmp_path_factory):
    """The host suite's record and stdout at one setting (the other runs the same code
    under autocast), run once for the two tests that read it."""
    return run_suite(tmp_path_factory.mktemp("host"), "host", "--settings", "float32 high",
                     "--batch-sizes", "1")


def test_host_suite_times_both_blocks(host_suite):
    record, _ = host_suite
    assert {(r["setting"], r["batch"]) for r in record["results"]} == {("float32 high", 1)}
    for r in record["results"]:
        assert r["host_us"]["stock"] > 0 and r["host_us"]["swapped"] > 0
        assert r["stock_over_swapped"] == pytest.approx(
            r["host_us"]["stock"] / r["host_us"]["swapped"])


def test_host_suite_times_the_hf_attention_half_too(host_suite):
    record, stdout = host_suite
    for r in record["results"]:
        assert r["host_us"]["hf stock"] > 0
        assert r["hf_stock_over_swapped"] == pytest.approx(
            r["host_us"]["hf stock"] / r["host_us"]["swapped"])
    assert stdout.strip().splitlines()[-1].startswith("| float32 high | 1 |")


def test_halves_suite_takes_each_attention_half_against_the_tower_without_them(tmp_path):
    record, stdout = run_suite(tmp_path, "halves", "--settings", "float32 high",
                               "--batch-sizes", "2")
    (result,) = record["results"]
    rows = result["rows"]
    assert set(rows) == {"stock", "swapped", "compiled stock", "compiled swapped",
                         "without attention", "compiled without attention"}
    for row in rows.values():
        check_row(row)
    assert set(result["attention_half_ms"]) == {"stock", "swapped", "compiled stock",
                                                "compiled swapped"}
    for name, half in result["attention_half_ms"].items():
        assert half["without"] == ("compiled " if name.startswith("compiled") else "") \
            + "without attention"
        assert half["per_layer_step_ms"] == pytest.approx(
            (rows[name]["median_ms"] - rows[half["without"]]["median_ms"])
            / result["layers"])
    assert stdout.strip().splitlines()[-1].startswith("| float32 high | 2 | compiled swapped |")
