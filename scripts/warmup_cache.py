"""Compile and autotune vitattn_bwd ahead of training, into a cache directory that later
processes reuse (vitattn_bwd.load_compile_cache(DIR) or VITATTN_BWD_CACHE=DIR).

    python scripts/warmup_cache.py --cache-dir ~/.cache/vitattn_bwd
    python scripts/warmup_cache.py --cache-dir DIR --batch-sizes 8 16 --seq-len 577

Default: the 16 contract batch sizes at 577 tokens, 1024 wide, 16 heads, on the current
device, for the backward in both LayerNorm modes and for VisionAttentionBlock's forward and
backward. It reports the cold time of each first call, then starts a fresh process on the
cache and reports its warm first calls and whether anything was compiled again.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vitattn_bwd  # noqa: E402
from vitattn_bwd import cache  # noqa: E402
from vitattn_bwd.workloads import BATCH_SIZES, EMBED_DIM, NUM_HEADS, SEQ_LEN  # noqa: E402


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


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--embed-dim", type=int, default=EMBED_DIM)
    parser.add_argument("--num-heads", type=int, default=NUM_HEADS)
    parser.add_argument("--ln-grad", nargs="+", default=["contract", "exact"],
                        choices=["contract", "exact"])
    parser.add_argument("--no-module", dest="module", action="store_false",
                        help="skip VisionAttentionBlock's forward and backward")
    parser.add_argument("--verify", action="store_true",
                        help="(internal) load the cache, time the warm first calls, print JSON")
    args = parser.parse_args()

    if args.verify:
        vitattn_bwd.load_compile_cache(args.cache_dir)
        timings = first_calls(args)
        print(json.dumps({"timings": timings, **compile_counters()}))
        return

    cache.use_cache_dir(args.cache_dir)
    cold = first_calls(args)
    cache.write_fingerprint(args.cache_dir)
    print(f"cold: {sum(cold.values()):.1f} s for {len(cold)} first calls; cache in "
          f"{args.cache_dir}")

    verify = subprocess.run([sys.executable, __file__, "--verify", *sys.argv[1:]],
                            capture_output=True, text=True, check=True)
    warm = json.loads(verify.stdout.strip().splitlines()[-1])
    print(f"\n| first call | cold s | warm s (fresh process) |\n|---|---|---|")
    for label, seconds in cold.items():
        print(f"| {label} | {seconds:.2f} | {warm['timings'][label]:.2f} |")
    print(f"| **total** | **{sum(cold.values()):.1f}** | "
          f"**{sum(warm['timings'].values()):.1f}** |")
    print(f"fresh process: {warm['fxgraph_cache_miss']} Inductor compiles, "
          f"{warm['fxgraph_cache_hit']} cache hits")


if __name__ == "__main__":
    main()
