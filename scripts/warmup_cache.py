"""Compile and autotune vitattn_bwd ahead of training, into a cache directory that later
processes reuse (vitattn_bwd.load_compile_cache(DIR) or VITATTN_BWD_CACHE=DIR).

    python scripts/warmup_cache.py --cache-dir ~/.cache/vitattn_bwd
    python scripts/warmup_cache.py --cache-dir DIR --batch-sizes 8 16 --seq-len 577

Default: the 16 contract batch sizes at 577 tokens, 1024 wide, 16 heads, on the current
device, for the backward in both LayerNorm modes and for VisionAttentionBlock's forward and
backward. On the H200 that set took 90-121 s cold; on a CPU, where
Inductor compiles every graph to C++, far longer: give a few --batch-sizes there. It reports the cold time of each first call, then starts a fresh process on the
cache and reports its warm first calls, whether anything was compiled again, and where the
warm first calls' time went (dynamo's per-phase timers, summed over the graphs).

--deterministic fills the cache for a training process that runs under
torch.use_deterministic_algorithms(True): Inductor's cache key holds that flag (and
torch.utils.deterministic.fill_uninitialized_memory), and dynamo guards on it, so a cache
filled without the flag serves no graph of such a process, which then compiles and
autotunes every graph again.

--compile-threads-1-check also times a second fresh process with
TORCHINDUCTOR_COMPILE_THREADS=1 in its environment (that process only): whether Inductor's
compile worker pool, which a warm load starts for its Triton kernels, costs the first calls
anything.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_STARTED = time.perf_counter()
import vitattn_bwd  # noqa: E402  (imported after _STARTED: the import is timed)
from vitattn_bwd import cache  # noqa: E402
from vitattn_bwd.workloads import BATCH_SIZES, EMBED_DIM, NUM_HEADS, SEQ_LEN  # noqa: E402

_IMPORTED = time.perf_counter()

# dynamo_timed phases of a warm first call (torch._dynamo.utils.compilation_time_metrics),
# as (label, metric). Nested: "dynamo compile" holds tracing, guards and the backend;
# the backend ("AOTAutograd + Inductor") holds the cache loads and key hashing.
PHASES = (
    ("dynamo compile, all of it", "_compile.compile_inner"),
    ("  dynamo bytecode tracing", "bytecode_tracing"),
    ("    fake-tensor propagation", "get_fake_value"),
    ("  guard building", "build_guards"),
    ("  AOTAutograd + Inductor (backend)", "OutputGraph.call_user_compiler"),
    ("    AOTAutograd cache: Inductor load", "AOTAutogradCache.inductor_load"),
    ("      generated module load (kernels)", "PyCodeCache.load_by_key_path"),
    ("    torch source hash (once)", "inductor_codecache_torch_key"),
    ("    triton source hash (once)", "CacheBase.get_system.triton_key"),
    ("    C++/Triton compiles", "compile_file"),
    ("    async_compile.wait", "async_compile.wait"),
    ("    Triton kernel reload in parent", "reload_kernel_in_parent"),
)


def progress(done, total, label, width=30):
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}",
          end="" if done < total else "\n", flush=True)


def first_calls(args):
    """Time the first call of each (batch size, job); returns {label: seconds}."""
    import torch
    from vitattn_bwd.workloads import make_inputs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    jobs = [(B, mode) for B in args.batch_sizes for mode in args.ln_grad]
    if args.module:
        jobs += [(B, "module") for B in args.batch_sizes]
        block = vitattn_bwd.VisionAttentionBlock(args.embed_dim, args.num_heads).to(device)
    timings = {}
    for i, (B, job) in enumerate(jobs):
        progress(i, len(jobs), f"batch {B}, {job}")
        start = time.perf_counter()
        if job == "module":
            x = torch.randn(B, args.seq_len, args.embed_dim, device=device, requires_grad=True)
            block(x).sum().backward()
        else:
            inputs = make_inputs(B, seq_len=args.seq_len, embed_dim=args.embed_dim,
                                 num_heads=args.num_heads, device=device)
            vitattn_bwd.attention_block_backward(**inputs, num_heads=args.num_heads,
                                                 ln_grad=job)
        if device == "cuda":
            torch.cuda.synchronize()
        timings[f"batch {B}, {job}"] = time.perf_counter() - start
    progress(len(jobs), len(jobs), "done")
    return timings


def compile_counters():
    import torch
    counters = torch._dynamo.utils.counters["inductor"]
    return {"fxgraph_cache_miss": counters["fxgraph_cache_miss"],
            "fxgraph_cache_hit": counters["fxgraph_cache_hit"]}


def phase_seconds():
    """{metric: seconds summed over this process's compiles} for PHASES' metrics."""
    from torch._dynamo.utils import compilation_time_metrics
    return {metric: sum(compilation_time_metrics.get(metric, ())) for _, metric in PHASES}


def child_processes():
    """Command names of this process's live children (Inductor's compile worker pool
    shows up as one: its sidecar)."""
    me, names = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            names.append(stat.read_text().split("(", 1)[1].rsplit(")", 1)[0])
    return names


def verify(args, extra_env=None):
    """A fresh process on the cache: its warm first calls, counters and phases."""
    env = dict(os.environ, **(extra_env or {}))
    run = subprocess.run([sys.executable, __file__, "--verify", *sys.argv[1:]],
                         capture_output=True, text=True, env=env)
    if run.returncode:
        sys.exit(f"the fresh process failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def print_phases(warm, label):
    total = sum(warm["timings"].values())
    print(f"\nwarm first calls ({label}): {total:.2f} s in all, after {warm['import_s']:.2f} s "
          f"of imports and {warm['load_s']:.3f} s of load_compile_cache; "
          f"children alive at the end: {warm['children'] or 'none'}")
    print("| phase (summed over the graphs) | s |\n|---|---|")
    for name, metric in PHASES:
        print(f"| {name} | {warm['phases'][metric]:.2f} |")
    outside = total - warm["phases"]["_compile.compile_inner"]
    print(f"| outside dynamo's compile (Inductor imports at the first compile, first runs, "
          f"CUDA graph recording, our Python) "
          f"| {outside:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, required=True,
                        help="where the compiled graphs and autotuning results go")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES),
                        help="default: the contract's %(default)s")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="default: %(default)s")
    parser.add_argument("--embed-dim", type=int, default=EMBED_DIM,
                        help="default: %(default)s")
    parser.add_argument("--num-heads", type=int, default=NUM_HEADS,
                        help="default: %(default)s")
    parser.add_argument("--ln-grad", nargs="+", default=["contract", "exact"],
                        choices=["contract", "exact"], help="default: %(default)s")
    parser.add_argument("--no-module", dest="module", action="store_false",
                        help="skip VisionAttentionBlock's forward and backward")
    parser.add_argument("--compile-threads-1-check", action="store_true",
                        help="also time a fresh process with TORCHINDUCTOR_COMPILE_THREADS=1")
    parser.add_argument("--deterministic", action="store_true",
                        help="compile under torch.use_deterministic_algorithms(True), as a "
                        "training process with that flag needs (CUBLAS_WORKSPACE_CONFIG "
                        "defaults to :4096:8)")
    parser.add_argument("--verify", action="store_true",
                        help="(internal) load the cache, time the warm first calls, print JSON")
    args = parser.parse_args()
    if args.deterministic:
        import torch
        # cuBLAS reads it when its first handle is made: before any CUDA work
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

    if args.verify:
        start = time.perf_counter()
        vitattn_bwd.load_compile_cache(args.cache_dir)
        load_s = time.perf_counter() - start
        timings = first_calls(args)
        print(json.dumps({"timings": timings, **compile_counters(), "phases": phase_seconds(),
                          "import_s": _IMPORTED - _STARTED, "load_s": load_s,
                          "children": child_processes()}))
        return

    cache.use_cache_dir(args.cache_dir)
    cold = first_calls(args)
    cache.write_fingerprint(args.cache_dir)
    counted = compile_counters()
    print(f"cold: {sum(cold.values()):.1f} s for {len(cold)} first calls "
          f"({counted['fxgraph_cache_miss']} Inductor compiles, "
          f"{counted['fxgraph_cache_hit']} cache hits); cache in {args.cache_dir}")

    warm = verify(args)
    single = verify(args, {"TORCHINDUCTOR_COMPILE_THREADS": "1"}) \
        if args.compile_threads_1_check else None
    extra = " | warm s, compile threads 1" if single else ""
    print(f"\n| first call | cold s | warm s (fresh process){extra} |\n|---|---|---|"
          + ("---|" if single else ""))
    for label, seconds in cold.items():
        more = f" | {single['timings'][label]:.2f}" if single else ""
        print(f"| {label} | {seconds:.2f} | {warm['timings'][label]:.2f}{more} |")
    more = f" | **{sum(single['timings'].values()):.2f}**" if single else ""
    print(f"| **total** | **{sum(cold.values()):.1f}** | "
          f"**{sum(warm['timings'].values()):.2f}**{more} |")
    print(f"fresh process: {warm['fxgraph_cache_miss']} Inductor compiles, "
          f"{warm['fxgraph_cache_hit']} cache hits")
    print_phases(warm, "default")
    if single:
        print_phases(single, "TORCHINDUCTOR_COMPILE_THREADS=1")


if __name__ == "__main__":
    main()
