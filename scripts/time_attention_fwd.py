"""Times the attention forward (vitattn_bwd.attention_fwd) on CUDA against float32 SDPA
and the module's current eager math (softmax(q k^T * scale) @ v, P materialized), TF32
off, at 577 tokens and 16 heads of 64 (ViT-L/14 at 336 px).

    PYTHONPATH=. python3 scripts/time_attention_fwd.py [--batch-sizes 1 8 32] [--sweep]

Columns: the operator (splitting q, k, v into bf16 hi/lo, then the kernel), the kernel
alone on pre-split inputs, SDPA on [B,H,S,D] (its heads still split: no merge counted),
the eager math with the heads merged, and the operator's relative error against float64.
Median of triton.testing.do_bench (L2 flushed before each run). --sweep then times tile
configurations of the kernel at the largest batch, for each head dim of --sweep-head-dims,
and names the fastest (what FWD_TILES in vitattn_bwd/attention_fwd.py should hold).
"""
import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import attention_fwd as fwd  # noqa: E402

SEQ_LEN, NUM_HEADS, HEAD_DIM = 577, 16, 64


def bench_ms(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def make_qkv(batch, seq_len=SEQ_LEN, num_heads=NUM_HEADS, head_dim=HEAD_DIM):
    """q, k, v as the module makes them: heads of one [B,S,3E] QKV output (strided)."""
    qkv = torch.randn(batch, seq_len, 3 * num_heads * head_dim, device="cuda")
    return [t.view(batch, seq_len, num_heads, head_dim).transpose(1, 2)
            for t in qkv.chunk(3, dim=-1)]


def eager_math(q, k, v, scale):
    """The module's current forward: P [B,H,S,S] materialized, heads merged."""
    B, H, S, D = q.shape
    attn_weights = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
    return (attn_weights @ v).transpose(1, 2).reshape(B, S, H * D)


def relative_error(q, k, v, scale):
    want = fwd.attention_math(q.double(), k.double(), v.double(), scale)[0]
    got = fwd.attention_fwd(q, k, v, scale)[0]
    return ((got.double() - want).norm() / want.norm()).item()


def timing_row(batch):
    """Times (ms) and the relative error at one batch size (its tensors are freed on
    return)."""
    q, k, v = make_qkv(batch)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    halves = [fwd.split_for_kernel(t) for t in (q, k, v)]
    return {"batch": batch,
            "operator": bench_ms(lambda: fwd.attention_fwd(q, k, v, scale)),
            "kernel": bench_ms(lambda: fwd.launch_attention_fwd_presplit(*halves, scale)),
            "sdpa": bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale)),
            "eager": bench_ms(lambda: eager_math(q, k, v, scale)),
            "error": relative_error(q, k, v, scale)}


def timing_rows(batch_sizes):
    """One dict of times (ms) and the relative error per batch size."""
    rows = []
    for batch in batch_sizes:
        rows.append(timing_row(batch))
        torch.cuda.empty_cache()
    return rows


def print_table(batch_sizes=(1, 8, 32)):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}: {SEQ_LEN} tokens, {NUM_HEADS} heads of "
          f"{HEAD_DIM}, float32, TF32 off; tiles {fwd.FWD_TILES[HEAD_DIM]}")
    print("\n| batch | operator ms | kernel ms | SDPA ms | eager ms | SDPA / operator "
          "| eager / operator | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    rows = timing_rows(batch_sizes)
    for r in rows:
        print(f"| {r['batch']} | {r['operator']:.3f} | {r['kernel']:.3f} | {r['sdpa']:.3f} "
              f"| {r['eager']:.3f} | {r['sdpa'] / r['operator']:.2f}x "
              f"| {r['eager'] / r['operator']:.2f}x | {r['error']:.1e} |", flush=True)
    return rows


def sweep_head_dim(batch, head_dim):
    """Time tile configs at one head dim, NUM_HEADS * HEAD_DIM wide; print the fastest
    (its tensors are freed on return)."""
    num_heads = NUM_HEADS * HEAD_DIM // head_dim
    q, k, v = make_qkv(batch, num_heads=num_heads, head_dim=head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    halves = [fwd.split_for_kernel(t) for t in (q, k, v)]
    want = fwd.attention_math(q.double(), k.double(), v.double(), scale)[0]
    print(f"\nsweep: batch {batch}, {num_heads} heads of {head_dim} "
          f"(default {tuple(fwd.FWD_TILES[head_dim])})")
    results = []
    for block_m, block_n, num_warps, num_stages in itertools.product(
            (64, 128), (32, 64, 128), (4, 8), (2, 3)):
        tiles = fwd.TileConfig(block_m, block_n, num_warps, num_stages)
        try:
            got = fwd.launch_attention_fwd_presplit(*halves, scale, tiles)[0]
            error = ((got.double() - want).norm() / want.norm()).item()
            ms = bench_ms(lambda: fwd.launch_attention_fwd_presplit(*halves, scale, tiles))
        except Exception as exc:            # out of shared memory or registers
            print(f"  {tuple(tiles)}: {type(exc).__name__}")
            continue
        results.append((ms, tiles))
        print(f"  {tuple(tiles)}: {ms:.3f} ms, rel. error {error:.1e}", flush=True)
    if results:
        ms, tiles = min(results)
        print(f"fastest for head_dim {head_dim}: {tuple(tiles)} at {ms:.3f} ms")


def sweep(batch, head_dims):
    """sweep_head_dim at each of head_dims."""
    for head_dim in head_dims:
        sweep_head_dim(batch, head_dim)
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-head-dims", type=int, nargs="+", default=[64, 128, 32])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("time_attention_fwd.py needs a CUDA GPU")
    print_table(args.batch_sizes)
    if args.sweep:
        sweep(max(args.batch_sizes), args.sweep_head_dims)


if __name__ == "__main__":
    main()
