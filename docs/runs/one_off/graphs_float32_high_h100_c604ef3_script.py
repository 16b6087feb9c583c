"""Probe: the module's float32-grade graphs with and without CUDA graphs, one process,
12-layer HF CLIP tower, float32 at given precision and batches. For each batch: stock,
swapped and their torch.compile with graph.MODULE_FLOAT32_CUDA_GRAPH_MAX_BATCH = 15
(graphed, the old routing), then swapped and compiled swapped with it = 0 (un-graphed)."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, "scripts")
import bench_towers as bt  # noqa: E402
from vitattn_bwd import graph  # noqa: E402

precision = sys.argv[1]
batches = [int(b) for b in sys.argv[2:]]
out = Path(os.environ.get("OUT", "results"))
torch.set_float32_matmul_precision(precision)
tower = bt.hf_tower("cuda", 12)
results = []
for batch in batches:
    pixels = bt.pixels_for(tower, batch, "cuda")
    for limit in (15, 0):
        graph.MODULE_FLOAT32_CUDA_GRAPH_MAX_BATCH = limit
        models = bt.tower_models(tower)
        if limit == 0:
            models = {k: v for k, v in models.items() if "swapped" in k}
        rows = bt.measure(models, pixels, bt.autocast_region("cuda", False), "cuda", 3, 3,
                          explain=False)
        results.append({"precision": precision, "batch": batch, "graphs_up_to": limit,
                        "rows": rows})
        (out / f"graphs_{precision}.json").write_text(json.dumps(results, indent=1))
        bt.print_rows(f"{precision}, batch {batch}, module float32 graphs up to {limit}",
                      rows)
print("\n| precision | batch | graphs up to | model | median ms | GPU-busy ms |")
print("|---|---|---|---|---|---|")
for r in results:
    for name, row in r["rows"].items():
        print(f"| {r['precision']} | {r['batch']} | {r['graphs_up_to']} | {name} | "
              f"{row['median_ms']:.2f} | {row['gpu_busy_ms']:.2f} |")
