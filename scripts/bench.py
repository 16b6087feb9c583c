"""Benchmark: vitattn_bwd against the eager float32 reference on the contract's 16
workloads, timed the way the benchmark's harness times it.

Per call: the inputs sit at fresh addresses (copied before, not timed), the L2 cache is
flushed, and the call lasts from its first GPU kernel's start to its last kernel's end
(torch.profiler timestamps), so host gaps between kernels count. Reported per batch size
beside that span: the CUDA-event time of the call, and the host time per call measured
with the GPU kept busy (so only the host is timed). Precision: every output of every
workload against the float32 reference, on `--seeds` fresh draws, by the contract's
tolerance rule (worst matched fraction, and the misses on the 1,024-element vectors).

On a machine without a GPU it runs a small CPU demo instead.

    python scripts/bench.py                      # all 16 batch sizes (GPU) or the demo
    python scripts/bench.py --batch-sizes 1 32   # a subset
    python scripts/bench.py --json out.json --plot out.png
"""
import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import (append_results, contract_rows, harness_times, host_ms_per_call,
                     spin_up)
from vitattn_bwd import contract, graph, reference
from vitattn_bwd.workloads import (BATCH_SIZES, EMBED_DIM, NUM_HEADS, OUTPUT_NAMES, SEQ_LEN,
                                   make_inputs, within_tolerance)

VECTOR_OUTPUTS = ("grad_qkv_bias", "grad_out_bias", "grad_ln_weight", "grad_ln_bias")
# The shapes that run: the contract's on a GPU, a small one for the CPU demo.
GPU_SHAPE = dict(seq_len=SEQ_LEN, embed_dim=EMBED_DIM, num_heads=NUM_HEADS)
CPU_SHAPE = dict(seq_len=65, embed_dim=128, num_heads=4)


def reference_fn(*args):
    return reference.attention_block_backward(*args, num_heads=args[7].shape[1],
                                              ln_grad="contract")


def check_precision(batch, seeds):
    """Worst matched fraction per output over `seeds` draws, and the most misses on any
    1,024-element vector output."""
    worst = {name: 1.0 for name in OUTPUT_NAMES}
    misses = {name: 0 for name in VECTOR_OUTPUTS}
    for seed in range(seeds):
        gen = torch.Generator(device="cuda").manual_seed(1000 * batch + seed)
        args = tuple(make_inputs(batch, device="cuda", generator=gen).values())
        with torch.no_grad():
            refs = reference_fn(*args)
        outputs = contract.run(*args)
        for name, out, ref in zip(OUTPUT_NAMES, outputs, refs):
            matched = within_tolerance(out, ref)[1]
            worst[name] = min(worst[name], matched)
            if name in misses:
                misses[name] = max(misses[name], round((1 - matched) * out.numel()))
    return worst, misses


# The previous release's host path (a383f51): the Python wrapper, CUDA graphs up to
# batch 15; timed beside ours with --previous.
PREVIOUS_SETTINGS = dict(CPP_WRAPPER_DEVICES=(), CUDA_GRAPH_MAX_BATCH=15)


@contextlib.contextmanager
def graph_settings(**settings):
    """graph.py's module settings replaced for a while, its compiled graphs dropped on
    entry and exit, so that each setting compiles graphs of its own."""
    saved = {name: getattr(graph, name) for name in settings}
    graph._compile.cache_clear()
    for name, value in settings.items():
        setattr(graph, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(graph, name, value)
        graph._compile.cache_clear()


def run_gpu(batch_sizes, calls, seeds, host_calls, previous):
    """One row per batch: ours (span, GPU busy, host, kernels, copies), the eager
    reference's and torch.compile(reference)'s spans (default mode, float32 matmuls
    as torch's defaults leave them: no TF32), with `previous` the span of ours at
    PREVIOUS_SETTINGS, and the precision of ours."""
    spin_up()
    compiled_reference = torch.compile(reference_fn)
    previous_ms = {}
    if previous:
        with graph_settings(**PREVIOUS_SETTINGS):
            for B in batch_sizes:
                args = tuple(make_inputs(B, device="cuda").values())
                previous_ms[B] = harness_times(contract.run, args, calls)["span_ms"]
                print(f"B={B:3d} previous {previous_ms[B]:.3f} ms", flush=True)
    rows = []
    for B in batch_sizes:
        worst, misses = check_precision(B, seeds)
        args = tuple(make_inputs(B, device="cuda").values())
        row = {"batch": B, "worst_matched": worst, "vector_misses": misses,
               "within_tolerance": all(m >= 0.99 for m in worst.values())}
        with torch.no_grad():
            row["eager_ms"] = harness_times(reference_fn, args, calls)["span_ms"]
            row["compiled_reference_ms"] = harness_times(compiled_reference, args,
                                                         calls)["span_ms"]
        if previous:
            row["previous_ms"] = previous_ms[B]
        ours = harness_times(contract.run, args, calls)
        row.update(vitattn_ms=ours["span_ms"], event_ms=ours["event_ms"],
                   busy_ms=ours["busy_ms"], copy_ms=ours["copy_ms"],
                   kernels=ours["kernels"],
                   host_ms=host_ms_per_call(contract.run, args, host_calls))
        rows.append(row)
        print(f"B={B:3d} ours {row['vitattn_ms']:.3f} ms (busy {row['busy_ms']:.3f}, host "
              f"{row['host_ms']:.3f}, copies {row['copy_ms']:.3f}, {row['kernels']} "
              f"kernels) eager {row['eager_ms']:.3f} compiled {row['compiled_reference_ms']:.3f}"
              f" worst={min(worst.values()):.5f} misses={max(misses.values())}", flush=True)
    return rows


def cpu_time(fn, args, repeats=3):
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_cpu_demo(batch_sizes):
    seq_len, embed_dim, num_heads = CPU_SHAPE.values()
    print(f"No CUDA GPU: a CPU demo of the contract's backward (15 inputs -> 7 gradients) "
          f"at seq_len={seq_len}, embed_dim={embed_dim}, num_heads={num_heads}, batch "
          f"{', '.join(map(str, batch_sizes))}.\n"
          "It checks correctness: each of the 7 gradients of contract.run against the "
          "float64 reference (vitattn_bwd.reference) by the benchmark's rule, >= 99% of "
          "its elements within 1e-2 + 1e-2 * |ref|.\nThe CPU path (Inductor's C++ "
          "backend) is for correctness, not speed: eager_ms (the float32 eager reference) "
          "and vitattn_ms are CPU times, not the benchmark's GPU figures.", flush=True)
    rows = []
    for B in batch_sizes:
        inputs = make_inputs(B, seq_len=seq_len, embed_dim=embed_dim, num_heads=num_heads)
        args = tuple(inputs.values())
        refs = reference.attention_block_backward(
            *(a.double() if torch.is_tensor(a) else a for a in args), num_heads=num_heads,
            ln_grad="contract")
        worst = {name: within_tolerance(o, r)[1]
                 for name, o, r in zip(OUTPUT_NAMES, contract.run(*args), refs)}
        rows.append({"batch": B, "eager_ms": cpu_time(reference_fn, args),
                     "vitattn_ms": cpu_time(contract.run, args), "worst_matched": worst,
                     "within_tolerance": all(m >= 0.99 for m in worst.values())})
        name = min(worst, key=worst.get)
        verdict = "all 7 gradients within" if rows[-1]["within_tolerance"] else "OUT OF"
        print(f"batch {B}: {verdict} tolerance against float64 (least matched: {name}, "
              f"{worst[name]:.5f} of its elements)", flush=True)
    return rows


def _nan_as_null(value):
    """value with every float NaN (a host time no clean try measured) as None: strict
    JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _nan_as_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_as_null(v) for v in value]
    return None if isinstance(value, float) and value != value else value


# Columns of the table, those present in the rows: ours, then the references.
TABLE_COLUMNS = ("vitattn_ms", "busy_ms", "host_ms", "copy_ms", "kernels", "eager_ms",
                 "compiled_reference_ms", "previous_ms")
# Time columns summed up by a geometric mean (the leaderboard's figure) and a mean.
SUMMARY_COLUMNS = ("vitattn_ms", "eager_ms", "compiled_reference_ms", "previous_ms")


def geometric_mean(values):
    return math.exp(statistics.mean(math.log(v) for v in values))


def print_table(rows):
    keys = [k for k in TABLE_COLUMNS if k in rows[0]]
    print("\n| batch | " + " | ".join(keys) + " | within tolerance | worst matched |")
    print("|---|" + "---|" * (len(keys) + 2))
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[k]:.3f}" for k in keys)
              + f" | {r['within_tolerance']} | {min(r['worst_matched'].values()):.5f} |")
    summary = {}
    for label, average in (("geometric mean", geometric_mean), ("mean", statistics.mean)):
        summary[label] = {k: average([r[k] for r in rows]) for k in SUMMARY_COLUMNS
                          if k in rows[0]}
        print(f"| **{label}** | " + " | ".join(
            f"**{summary[label][k]:.3f}**" if k in summary[label] else "" for k in keys)
            + f" | {all(r['within_tolerance'] for r in rows)} | "
            + f"{min(min(r['worst_matched'].values()) for r in rows):.5f} |")
    worst_per_output = {name: min(r["worst_matched"][name] for r in rows)
                        for name in OUTPUT_NAMES}
    print("\nworst matched fraction per output: "
          + ", ".join(f"{n}={v:.5f}" for n, v in worst_per_output.items()))
    if "vector_misses" in rows[0]:
        print("most misses per 1,024-element vector: " + ", ".join(
            f"{n}={max(r['vector_misses'][n] for r in rows)}" for n in VECTOR_OUTPUTS))
    return summary, worst_per_output


def plot(rows, path, shape):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    batches = [r["batch"] for r in rows]
    for key in ("eager_ms", "compiled_reference_ms", "previous_ms", "vitattn_ms"):
        if key not in rows[0]:
            continue
        plt.plot(batches, [r[key] for r in rows], marker="o", label=key[:-3])
    plt.xlabel(f"batch size ({shape['seq_len']} tokens, {shape['embed_dim']} wide, "
               f"{shape['num_heads']} heads)")
    plt.ylabel("first kernel to last kernel, ms (L2 flushed, fresh inputs)")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per size")
    parser.add_argument("--seeds", type=int, default=3, help="precision draws per size")
    parser.add_argument("--host-calls", type=int, default=10,
                        help="calls per host-time measurement (~40 launches each must fit "
                             "in the GPU's launch queue, about 1,000 deep)")
    parser.add_argument("--previous", action="store_true",
                        help="also time ours at the previous release's host path "
                             "(PREVIOUS_SETTINGS)")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append the GPU figures to results/runs.csv")
    parser.add_argument("--json", type=Path, default=Path("results/bench.json"))
    parser.add_argument("--plot", type=Path, default=Path("results/bench.png"))
    args = parser.parse_args()

    if torch.cuda.is_available():
        start = time.perf_counter()
        rows = run_gpu(args.batch_sizes or BATCH_SIZES, args.calls, args.seeds,
                       args.host_calls, args.previous)
        if not args.no_record:
            append_results(contract_rows(rows, "python3 scripts/bench.py "
                                         + " ".join(sys.argv[1:])))
        device, shape = torch.cuda.get_device_name(), GPU_SHAPE
        print(f"\n{device}, torch {torch.__version__}; wall time "
              f"{time.perf_counter() - start:.0f} s including compiles")
    else:
        rows = run_cpu_demo(args.batch_sizes or (1, 2, 4))
        device, shape = "cpu", CPU_SHAPE
    summary, worst = print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device, "torch": torch.__version__, "triton": _triton_version(),
              **shape, "rows": rows, "summary_ms": summary, "worst_matched": worst}
    args.json.write_text(json.dumps(_nan_as_null(record), indent=1))
    print(f"results written to {args.json}")
    if len(rows) > 1:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.plot, shape)
    if not all(r["within_tolerance"] for r in rows):
        sys.exit("some outputs are out of tolerance")


if __name__ == "__main__":
    main()
