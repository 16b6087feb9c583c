"""The attention core, the attention forward, the LayerNorm kernel and the contract's call
on the GPU, checked against float64 and timed, one --kernel a call:

    python3 scripts/time_kernels.py --kernel KERNEL [--batch 32] [--out DIR]

  attention_fwd   the fused attention forward (attention_fwd.py) against float32 SDPA and
                  the eager math (P materialized), TF32 off, at --batch-sizes (1 8 32);
                  --sweep then times tile configurations at --sweep-head-dims
  core_gluon      the Gluon two-pass kernels (softmax_bwd_gluon.py) against the Triton kernels,
                  P given and recomputed, at several L2 prefetch distances of P
  core_half       the one-product Gluon kernels (bf16 / fp16, P recomputed) against
                  torch's attention backwards, per tile config (--dtypes)
  core_head_dims  the core at head dims 64, 72 and 80 (ViT-L/14, SigLIP so400m, ViT-H/14)
                  against float64 and SDPA's backwards
  core_ws         the warp-specialized one-pass core (attention_bwd_ws.py) against the
                  Gluon rows + cols and SDPA's raw flash and cuDNN backwards, its delta
                  kernels, the forwards the deterministic attention could run; --sm90: its
                  machine code for sm_90 on any machine (one JSON line)
  layer_norm      the fused LayerNorm backward at several launch configurations against
                  Inductor's code of the same math, at --batch-sizes (1 8 32)
  contract        CUDA kernels of one contract call ranked and grouped by kind under
                  torch.profiler (--module: one VisionAttentionBlock fwd+bwd step;
                  --autocast, --stock, --float32-precision, --trace)
  margin          the contract's margin per output against float64 at --batch-sizes
                  (32 56 420 1850), with the autotune choices of each (run it on an empty
                  TORCHINDUCTOR_CACHE_DIR to see them)

Times are medians of triton.testing.do_bench with the L2 flushed (harness.bench_ms);
checks write into NaN-poisoned buffers. Each prints a table last, writes
DIR/KERNEL.json (DIR: --out, else $OUT, else .) and appends its timings to
results/runs.csv (harness.append_results; --no-record skips that).
"""
import argparse
import collections
import itertools
import json
import math
import os
import re
import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import harness                   # run as python3 scripts/time_kernels.py
except ModuleNotFoundError:          # imported as scripts.time_kernels (the tests)
    from scripts import harness

from vitattn_bwd import (attention_bwd_ws, contract, layer_norm_bwd, softmax_bwd,
                         softmax_bwd_gluon)
from vitattn_bwd import attention_fwd as fwd
from vitattn_bwd.softmax_bwd import TileConfig
from vitattn_bwd.attention_fwd import attention_fwd_half
from vitattn_bwd.layer_norm_bwd import LayerNormTiles
from vitattn_bwd.layout import merge_heads, split_heads
from vitattn_bwd.precision import Products, fused_products
from vitattn_bwd.workloads import make_inputs as contract_inputs

S, H, D, E = harness.S, harness.H, harness.D, harness.E
bench_ms, halves_of, rel = harness.bench_ms, harness.halves_of, harness.rel
SCALE = 1 / math.sqrt(D)
KERNELS = ("attention_fwd", "core_gluon", "core_half", "core_head_dims", "core_ws",
           "layer_norm", "contract", "margin")


# ------------------------------------------------------------------- attention_fwd

def make_qkv(batch, seq_len=S, num_heads=H, head_dim=D):
    """q, k, v as the module makes them: heads of one [B,S,3E] QKV output (strided)."""
    qkv = torch.randn(batch, seq_len, 3 * num_heads * head_dim, device="cuda")
    return [t.view(batch, seq_len, num_heads, head_dim).transpose(1, 2)
            for t in qkv.chunk(3, dim=-1)]


def eager_math(q, k, v, scale):
    """The module's eager forward: P [B,H,S,S] materialized, heads merged."""
    B, H_, S_, D_ = q.shape
    probs = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
    return (probs @ v).transpose(1, 2).reshape(B, S_, H_ * D_)


def fwd_timing_row(batch):
    """Times (ms) of the operator (split, then the kernel), the kernel alone on pre-split
    inputs, SDPA on [B,H,S,D] and the eager math; the operator's error against float64."""
    q, k, v = make_qkv(batch)
    halves = [fwd.split_for_kernel(t) for t in (q, k, v)]
    want = fwd.attention_math(q.double(), k.double(), v.double(), SCALE)[0]
    got = fwd.attention_fwd(q, k, v, SCALE)[0]
    return {"batch": batch,
            "operator": bench_ms(lambda: fwd.attention_fwd(q, k, v, SCALE)),
            "kernel": bench_ms(lambda: fwd.launch_attention_fwd_presplit(*halves, SCALE)),
            "sdpa": bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE)),
            "eager": bench_ms(lambda: eager_math(q, k, v, SCALE)),
            "error": rel(got, want)}


def attention_fwd_table(batch_sizes=(1, 8, 32)):
    """Prints the forward's table (TF32 off) and returns its rows."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}: {S} tokens, {H} heads of {D}, float32, TF32 "
          f"off; tiles {fwd.FWD_TILES[D]}")
    print("\n| batch | operator ms | kernel ms | SDPA ms | eager ms | SDPA / operator "
          "| eager / operator | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for batch in batch_sizes:
        r = fwd_timing_row(batch)
        torch.cuda.empty_cache()
        rows.append(r)
        print(f"| {r['batch']} | {r['operator']:.3f} | {r['kernel']:.3f} | {r['sdpa']:.3f} "
              f"| {r['eager']:.3f} | {r['sdpa'] / r['operator']:.2f}x "
              f"| {r['eager'] / r['operator']:.2f}x | {r['error']:.1e} |", flush=True)
    return rows


def fwd_sweep(batch, head_dim):
    """Times the forward's tile configs at one head dim, H * D wide; prints the fastest
    (what FWD_TILES in vitattn_bwd/attention_fwd.py should hold)."""
    num_heads = H * D // head_dim
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
            error = rel(got, want)
            ms = bench_ms(lambda: fwd.launch_attention_fwd_presplit(  # noqa: B023
                *halves, scale, tiles))
        except Exception as exc:            # out of shared memory or registers
            print(f"  {tuple(tiles)}: {type(exc).__name__}")
            continue
        results.append((ms, tiles))
        print(f"  {tuple(tiles)}: {ms:.3f} ms, rel. error {error:.1e}", flush=True)
    if results:
        ms, tiles = min(results)
        print(f"fastest for head_dim {head_dim}: {tuple(tiles)} at {ms:.3f} ms")


def run_attention_fwd(args, record):
    rows = attention_fwd_table(args.batch_sizes or (1, 8, 32))
    for r in rows:
        for name in ("operator", "kernel", "sdpa", "eager"):
            record(f"attention forward {name}", r["batch"], "float32", r[name])
    if args.sweep:
        for head_dim in args.sweep_head_dims:
            fwd_sweep(max(args.batch_sizes or (32,)), head_dim)
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------- core_gluon

TRITON_TILES = {"rows": TileConfig(64, 32, 4, 3), "cols": TileConfig(64, 64, 4, 2)}
# (rows tiles, rows prefetch distance, cols tiles, cols prefetch distance) with P given;
# with P recomputed (no P to prefetch) the configured tiles only
ROWS_64x32, ROWS_64x64 = softmax_bwd_gluon.ROWS_TILES
COLS_32x64, COLS_64x64 = softmax_bwd_gluon.COLS_TILES
GLUON_VARIANTS = [(ROWS_64x32, softmax_bwd_gluon.ROWS_PREFETCH, COLS_32x64, softmax_bwd_gluon.COLS_PREFETCH),
                  (ROWS_64x32, 0, COLS_32x64, 0), (ROWS_64x32, 6, COLS_32x64, 1),
                  (ROWS_64x32, 8, COLS_32x64, 3), (ROWS_64x64, 4, COLS_64x64, 1)]


def gluon_inputs(batch, recompute, seed=0):
    """(P or its log-sum-exp, grad_attn, q, k, v, O or None, scale) in float32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    q, k, v = randn(batch, H, S, D), randn(batch, H, S, D), randn(batch, H, S, D)
    grad_attn = randn(batch, S, E)
    if recompute:
        logits = (q @ k.transpose(-1, -2)) * SCALE
        lse = torch.logsumexp(logits, -1)
        out = (torch.softmax(logits, -1) @ v).transpose(1, 2).reshape(batch, S, E)
        del logits
        return lse, grad_attn, q, k, v, out.contiguous(), SCALE
    probs = torch.softmax(randn(batch, H, S, S), -1)
    return probs, grad_attn, q, k, v, None, SCALE


def given(p_or_lse, attn_output):
    """probs= or lse= for the launchers: the log-sum-exp where the forward's output goes
    with it (module mode), else P."""
    return dict(probs=p_or_lse) if attn_output is None else dict(lse=p_or_lse)


def gluon_outputs(p_or_lse, halves, attn_output, scale, rows_tiles, cols_tiles,
                  rows_prefetch=softmax_bwd_gluon.ROWS_PREFETCH,
                  cols_prefetch=softmax_bwd_gluon.COLS_PREFETCH):
    """(rows, cols) launch closures of the three-product Gluon kernels and their
    NaN-poisoned outputs."""
    batch = halves[2].shape[0]
    delta = torch.full((batch, H, S), float("nan"), device="cuda")
    grad_q_halves = torch.full((batch, S, 2 * E), float("nan"), device="cuda",
                               dtype=torch.bfloat16)
    grad_q16 = torch.full((batch, S, E), float("nan"), device="cuda", dtype=torch.float16)
    grad_kv_halves = torch.full((batch, S, 4 * E), float("nan"), device="cuda",
                                dtype=torch.bfloat16)
    grad_kv16 = torch.full((batch, S, 2 * E), float("nan"), device="cuda",
                           dtype=torch.float16)
    groups = softmax_bwd.sum_groups(S)
    grad_q_sums = torch.full((batch, groups, E), float("nan"), device="cuda")
    grad_kv_sums = torch.full((batch, groups, 2 * E), float("nan"), device="cuda")
    placeholder = p_or_lse if attn_output is None else attn_output
    p_or_lse_given = given(p_or_lse, attn_output)

    def rows():
        softmax_bwd_gluon.launch_rows(*halves, placeholder, delta, grad_q_halves,
                                      grad_q_sums, grad_q16, scale, rows_tiles,
                                      prefetch=rows_prefetch, **p_or_lse_given)

    def cols():
        softmax_bwd_gluon.launch_cols(*halves, delta, grad_kv_halves, grad_kv_sums,
                                      grad_kv16, scale, cols_tiles, prefetch=cols_prefetch,
                                      **p_or_lse_given)
    return (rows, cols), (grad_q16, grad_q_halves, delta, grad_q_sums, grad_kv16,
                          grad_kv_halves, grad_kv_sums)


def triton_outputs(p_or_lse, grad_attn, q, k, v, attn_output, scale):
    grad_q16, grad_q_halves, delta, grad_q_sums = softmax_bwd.launch_rows(
        grad_attn, q, k, v, attn_output, scale, **given(p_or_lse, attn_output),
        block_m=TRITON_TILES["rows"].block_m, block_n=TRITON_TILES["rows"].block_n)
    grad_kv16, grad_kv_halves, grad_kv_sums = softmax_bwd.launch_cols(
        grad_attn, q, k, v, delta, scale, **given(p_or_lse, attn_output))
    return grad_q16, grad_q_halves, delta, grad_q_sums, grad_kv16, grad_kv_halves, grad_kv_sums


def compare(got, ref):
    names = ("grad_q16", "grad_q", "delta", "grad_q_sums", "grad_kv16", "grad_kv",
             "grad_kv_sums")
    errors = {}
    for name, g, r in zip(names, got, ref):
        if name in ("grad_q", "grad_kv"):
            g, r = softmax_bwd.float32_from_halves(g), softmax_bwd.float32_from_halves(r)
        if name.endswith("_sums"):           # where a program puts its sum depends on
            g, r = g.sum(1), r.sum(1)        # its block of rows; their totals do not
        errors[name] = float("nan") if torch.isnan(g.float()).any() else rel(g, r)
    return errors


def gluon_float64_check():
    """Gluon at batch 2 against the float64 math, both modes."""
    results = {}
    for recompute in (False, True):
        probs, grad_attn, q, k, v, out, scale = gluon_inputs(2, recompute, seed=1)
        halves = halves_of(grad_attn, q, k, v)
        (rows, cols), got = gluon_outputs(probs, halves, out, scale,
                                          softmax_bwd_gluon.ROWS_TILES[0], softmax_bwd_gluon.COLS_TILES[0])
        rows()
        cols()
        ref = softmax_bwd.attention_backward_math(
            *(t.double() for t in (grad_attn, q, k, v)), scale,
            **given(probs.double(), out),
            attn_output=None if out is None else out.double())
        grad_k, grad_v = softmax_bwd.float32_from_halves(got[5]).chunk(2, dim=-1)
        results["recompute" if recompute else "P given"] = [
            rel(softmax_bwd.float32_from_halves(got[1]), ref[0]), rel(grad_k, ref[1]),
            rel(grad_v, ref[2])]
    return results


def run_core_gluon(args, record):
    report = {"float64 check (dQ, dK, dV rel. error), batch 2": gluon_float64_check()}
    print(json.dumps(report), flush=True)
    table = []
    for recompute in (False, True):
        mode = "recompute" if recompute else "P given"
        probs, grad_attn, q, k, v, out, scale = gluon_inputs(args.batch, recompute)
        halves = halves_of(grad_attn, q, k, v)
        ref = triton_outputs(probs, grad_attn, q, k, v, out, scale)
        triton_ms = {
            "rows": bench_ms(lambda: softmax_bwd.launch_rows(
                grad_attn, q, k, v, out, scale, **given(probs, out),  # noqa: B023
                block_m=TRITON_TILES["rows"].block_m,
                block_n=TRITON_TILES["rows"].block_n)),
            "cols": bench_ms(lambda: softmax_bwd.launch_cols(
                grad_attn, q, k, v, ref[2], scale, **given(probs, out)))}  # noqa: B023
        for name in ("rows", "cols"):
            table.append((mode, "triton", name, tuple(TRITON_TILES[name]), "-",
                          triton_ms[name], {}))
        variants = GLUON_VARIANTS if not recompute else [(ROWS_64x32, 0, COLS_64x64, 0),
                                                         (ROWS_64x64, 0, COLS_32x64, 0)]
        for rows_tiles, rows_prefetch, cols_tiles, cols_prefetch in variants:
            try:
                (rows, cols), got = gluon_outputs(probs, halves, out, scale, rows_tiles,
                                                  cols_tiles, rows_prefetch, cols_prefetch)
                rows()
                got[2].copy_(ref[2])             # cols pass on the reference delta
                cols()
                torch.cuda.synchronize()
                errors = compare(got, ref)
                rows_ms, cols_ms = bench_ms(rows), bench_ms(cols)
            except Exception as error:          # report and go on to the next variant
                errors, rows_ms, cols_ms = {"error": repr(error)[:300]}, float("nan"), float("nan")
            table.append((mode, "gluon", "rows", tuple(rows_tiles), rows_prefetch, rows_ms,
                          {k: v for k, v in errors.items()
                           if k in ("grad_q16", "grad_q", "delta", "grad_q_sums", "error")}))
            table.append((mode, "gluon", "cols", tuple(cols_tiles), cols_prefetch, cols_ms,
                          {k: v for k, v in errors.items()
                           if k in ("grad_kv16", "grad_kv", "grad_kv_sums", "error")}))
    print(f"batch {args.batch}")
    print(f"{'mode':10} {'kernel':7} {'pass':5} {'tiles':18} {'pref':>4} {'ms':>7}  errors vs triton")
    for mode, kind, name, tiles, prefetch, ms, errors in table:
        err = " ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in errors.items())
        print(f"{mode:10} {kind:7} {name:5} {tiles!s:18} {prefetch!s:>4} {ms:7.3f}  {err}")
        record(f"core {kind} {name} pass", args.batch,
               f"float32 high, {mode}, tiles {tiles}, prefetch {prefetch}", ms)
    return table


# ----------------------------------------------------------------------- core_half

# tiles timed beside softmax_bwd_gluon's (each compiles for sm_90 without spills at one product:
# scripts/kernel_resources.py)
CANDIDATE_TILES = {"rows": (TileConfig(64, 32, 4, 3), TileConfig(128, 32, 8, 2),
                            TileConfig(128, 64, 8, 2)),
                   "cols": (TileConfig(32, 64, 4, 2), TileConfig(16, 64, 4, 3),
                            TileConfig(32, 128, 8, 2), TileConfig(32, 128, 8, 3))}
BACKENDS = {"torch flash": SDPBackend.FLASH_ATTENTION, "torch cudnn": SDPBackend.CUDNN_ATTENTION,
            "torch efficient": SDPBackend.EFFICIENT_ATTENTION}


def half_inputs(batch, dtype, seed=0):
    """q, k, v [B,H,S,D] as views of one qkv [B,S,3E], grad_attn, the attention output
    [B,S,E] and the log-sum-exp from torch's flash forward (the block's own), in `dtype`
    (the log-sum-exp float32)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, S, 3 * E, device="cuda", generator=g).to(dtype)
    q, k, v = (split_heads(t, H) for t in qkv.chunk(3, dim=-1))
    grad_attn = torch.randn(batch, S, E, device="cuda", generator=g).to(dtype)
    attn_output, lse = attention_fwd_half(q, k, v, SCALE)
    return q, k, v, grad_attn, attn_output.contiguous(), lse


def half_passes(q, k, v, grad_attn, attn_output, lse, rows_tiles, cols_tiles):
    """(rows, cols) launch closures of the one-product kernels and their outputs (grad_q
    [B,S,E], grad_kv [B,S,2E] in q's dtype, delta, the bias sums)."""
    batch = q.shape[0]
    groups = softmax_bwd.sum_groups(S)
    delta = torch.empty(batch, H, S, device="cuda")
    grad_q = torch.full((batch, S, E), float("nan"), device="cuda", dtype=q.dtype)
    grad_kv = torch.full((batch, S, 2 * E), float("nan"), device="cuda", dtype=q.dtype)
    grad_q_sums = torch.empty(batch, groups, E, device="cuda")
    grad_kv_sums = torch.empty(batch, groups, 2 * E, device="cuda")
    unused = grad_q_sums                          # the halves of float32 operands
    operands = (grad_attn, grad_attn, q, q, k, k, v, v)

    def rows():
        softmax_bwd_gluon.launch_rows(*operands, attn_output, delta, unused, grad_q_sums,
                                      grad_q, SCALE, rows_tiles,
                                      products=fused_products(None, q.dtype), prefetch=0,
                                      lse=lse)

    def cols():
        softmax_bwd_gluon.launch_cols(*operands, delta, unused, grad_kv_sums, grad_kv, SCALE,
                                      cols_tiles, products=fused_products(None, q.dtype),
                                      prefetch=0, lse=lse)
    return (rows, cols), (grad_q, grad_kv, delta, grad_q_sums, grad_kv_sums)


def torch_backward(backend, q, k, v, grad_attn, scale=SCALE):
    """(backward closure, (dQ, dK, dV) merged [B,S,E]) of F.scaled_dot_product_attention
    with one backend."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    grad_out = split_heads(grad_attn, q.shape[1])

    def backward():
        return torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    return backward, [merge_heads(g) for g in backward()]


def cudnn_forward(q, k, v, scale):
    """cuDNN's attention forward: output [B,S,E] and log-sum-exp [B,H,S]."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, scale=scale)[:2]
    return merge_heads(out), lse.reshape(q.shape[:3])


def half_float64_check(dtype):
    q, k, v, grad_attn, out, lse = half_inputs(2, dtype, seed=1)
    ref = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn, q, k, v)), SCALE, lse=lse.double())
    lse_check = rel(lse, torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * SCALE,
                                         -1))
    tiles = softmax_bwd_gluon.ROWS_TILES[0], softmax_bwd_gluon.COLS_TILES[0]
    (rows, cols), got = half_passes(q, k, v, grad_attn, out, lse, *tiles)
    rows()
    cols()
    (rows, cols), from_copies = half_passes(*(t.contiguous() for t in (q, k, v)), grad_attn,
                                            out, lse, *tiles)
    rows()
    cols()
    grad_k, grad_v = got[1].chunk(2, dim=-1)
    cudnn_out, cudnn_lse = cudnn_forward(q, k, v, SCALE)
    result = {"views == contiguous copies (bitwise)": all(
                  torch.equal(a, b) for a, b in zip(got, from_copies)),
              "cudnn forward vs flash (output, lse)": [rel(cudnn_out, out),
                                                       rel(cudnn_lse, lse)],
              "lse vs float64": lse_check,
              "ours": [rel(got[0], ref[0]), rel(grad_k, ref[1]), rel(grad_v, ref[2])],
              "bias sums": [rel(got[3].sum((0, 1)), ref[0].sum((0, 1))),
                            rel(got[4].sum((0, 1)), torch.cat(ref[1:], -1).sum((0, 1)))]}
    for name, backend in BACKENDS.items():
        try:
            _, grads = torch_backward(backend, q, k, v, grad_attn)
            result[name] = [rel(g, r) for g, r in zip(grads, ref)]
        except RuntimeError as error:
            result[name] = repr(error)[:200]
    return result


def run_core_half(args, record):
    report, table = {}, []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        name = str(dtype).removeprefix("torch.")
        report[f"float64 check {name}, batch 2 (dQ, dK, dV rel. error)"] = \
            half_float64_check(dtype)
        print(json.dumps(report), flush=True)
        q, k, v, grad_attn, out, lse = half_inputs(args.batch, dtype)
        for rows_tiles in softmax_bwd_gluon.ROWS_TILES + CANDIDATE_TILES["rows"]:
            (rows, _), _ = half_passes(q, k, v, grad_attn, out, lse, rows_tiles, rows_tiles)
            table.append((name, "ours rows", tuple(rows_tiles), bench_ms(rows)))
        for cols_tiles in softmax_bwd_gluon.COLS_TILES + CANDIDATE_TILES["cols"]:
            (rows, cols), _ = half_passes(q, k, v, grad_attn, out, lse,
                                          softmax_bwd_gluon.ROWS_TILES[0], cols_tiles)
            rows()
            table.append((name, "ours cols", tuple(cols_tiles), bench_ms(cols)))
        for forward_name, forward in (("flash forward", attention_fwd_half),
                                      ("cudnn forward", cudnn_forward)):
            table.append((name, forward_name, "-",
                          bench_ms(lambda: forward(q, k, v, SCALE))))  # noqa: B023
        for backend_name, backend in BACKENDS.items():
            try:
                backward, _ = torch_backward(backend, q, k, v, grad_attn)
                table.append((name, backend_name, "-", bench_ms(backward)))
            except RuntimeError as error:
                table.append((name, backend_name, repr(error)[:60], float("nan")))
    report["batch"] = args.batch
    report["table"] = table
    print(f"batch {args.batch}: ms (median, L2 flushed)")
    for dtype, kernel, tiles, ms in table:
        print(f"{dtype:9} {kernel:16} {tiles!s:18} {ms:7.3f}")
        record(f"core one product {kernel}", args.batch, f"{dtype}, tiles {tiles}", ms)
    return report


# ------------------------------------------------------------------ core_head_dims

SHAPES = [("ViT-L/14-336", 577, 16, 64), ("SigLIP so400m", 729, 16, 72),
          ("ViT-H/14", 257, 16, 80)]
SDPA_BACKENDS = {"sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION}


def head_dim_inputs(batch, seq_len, num_heads, head_dim, seed):
    """float32 q, k, v [B,H,S,D], grad_attn [B,S,E], P [B,H,S,S], its log-sum-exp
    [B,H,S] and the attention output O [B,S,E] (P v), from float32 math."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, num_heads, seq_len, head_dim, device="cuda", generator=g)
               for _ in range(3))
    grad_attn = torch.randn(batch, seq_len, num_heads * head_dim, device="cuda", generator=g)
    logits = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(head_dim))
    probs = torch.softmax(logits, -1)
    return q, k, v, grad_attn, probs, torch.logsumexp(logits, -1), merge_heads(probs @ v)


def gluon_passes(p_or_lse, operands, attn_output, scale, head_dim, products):
    """(rows, cols, grads) closures of the Gluon kernels at any head dim: the launches,
    and their NaN-poisoned outputs (grad_q, grad_kv, delta, ...) read back in float32.
    operands: the eight (grad_attn, q, k, v) hi / lo tensors; products Products.BF16X3
    (bf16 halves) or ONE_BF16 (bf16, lo = hi)."""
    batch, num_heads, seq_len, _ = operands[2].shape
    width = num_heads * head_dim
    nan = dict(device="cuda", fill_value=float("nan"))
    gradient = products.gradient_dtype
    delta = torch.full((batch, num_heads, seq_len), **nan)
    grad_q16 = torch.full((batch, seq_len, width), dtype=gradient, **nan)
    grad_q_halves = torch.full((batch, seq_len, products.halves_width(width)),
                               dtype=torch.bfloat16, **nan)
    grad_kv16 = torch.full((batch, seq_len, 2 * width), dtype=gradient, **nan)
    grad_kv_halves = torch.full((batch, seq_len, products.halves_width(2 * width)),
                                dtype=torch.bfloat16, **nan)
    groups = softmax_bwd.sum_groups(seq_len)
    grad_q_sums = torch.full((batch, groups, width), **nan)
    grad_kv_sums = torch.full((batch, groups, 2 * width), **nan)
    placeholder = p_or_lse if attn_output is None else attn_output
    rows_tiles, cols_tiles = softmax_bwd_gluon.rows_tiles(head_dim)[0], softmax_bwd_gluon.cols_tiles(head_dim)[0]
    p_or_lse_given = given(p_or_lse, attn_output)
    prefetch = {} if attn_output is None else dict(prefetch=0)

    def rows():
        softmax_bwd_gluon.launch_rows(*operands, placeholder, delta, grad_q_halves,
                                      grad_q_sums, grad_q16, scale, rows_tiles, products,
                                      **prefetch, **p_or_lse_given)

    def cols():
        softmax_bwd_gluon.launch_cols(*operands, delta, grad_kv_halves, grad_kv_sums,
                                      grad_kv16, scale, cols_tiles, products, **prefetch,
                                      **p_or_lse_given)

    def grads():
        if products is Products.BF16X3:
            return (softmax_bwd.float32_from_halves(grad_q_halves),
                    softmax_bwd.float32_from_halves(grad_kv_halves), delta,
                    grad_q16, grad_kv16, grad_q_sums, grad_kv_sums)
        return (grad_q16.float(), grad_kv16.float(), delta, grad_q_sums, grad_kv_sums)
    return rows, cols, grads


def errors_of(grad_q, grad_kv, want):
    grad_k, grad_v = grad_kv.chunk(2, dim=-1)
    return [rel(g, w) for g, w in zip((grad_q, grad_k, grad_v), want)]


def head_dims_float64_check(seq_len, num_heads, head_dim):
    """{variant: [dQ, dK, dV relative errors] or a note} at batch 2: float32 "high"
    through the Gluon and the Triton kernels, bf16 one product beside SDPA's."""
    q, k, v, grad_attn, probs, lse, attn_output = head_dim_inputs(2, seq_len, num_heads,
                                                                  head_dim, seed=1)
    scale = 1 / math.sqrt(head_dim)
    want = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad_attn, q, k, v)), scale, probs=probs.double())
    result = {}
    for mode, p_or_lse, out in (("P given", probs, None), ("recompute", lse, attn_output)):
        rows, cols, grads = gluon_passes(p_or_lse, halves_of(grad_attn, q, k, v), out,
                                         scale, head_dim, products=Products.BF16X3)
        rows()
        cols()
        outputs = grads()
        unwritten = sum(int(t.float().isnan().sum()) for t in outputs)
        result[f"f32 gluon {mode}"] = errors_of(outputs[0], outputs[1], want) + (
            [f"{unwritten} NaN"] if unwritten else [])
        got = softmax_bwd.attention_backward(grad_attn, q, k, v, scale,
                                             **given(p_or_lse, out), attn_output=out)
        result[f"f32 triton {mode}"] = [rel(g, w) for g, w in zip(got, want)]
    # one product in bf16, P recomputed: against the float64 math on the bf16 values
    # (their log-sum-exp and output from float64 too)
    q16, k16, v16, grad16 = (t.bfloat16() for t in (q, k, v, grad_attn))
    logits16 = (q16.double() @ k16.double().transpose(-1, -2)) * scale
    probs16 = torch.softmax(logits16, -1)
    want16 = softmax_bwd.attention_backward_math(
        *(t.double() for t in (grad16, q16, k16, v16)), scale, probs=probs16)
    rows, cols, grads = gluon_passes(
        torch.logsumexp(logits16, -1).float(),
        [t for t in (grad16, q16, k16, v16) for _ in (0, 1)],
        merge_heads(probs16 @ v16.double()).bfloat16(), scale, head_dim,
        products=Products.ONE_BF16)
    rows()
    cols()
    outputs = grads()
    unwritten = sum(int(t.float().isnan().sum()) for t in outputs)
    result["bf16 gluon recompute"] = errors_of(outputs[0], outputs[1], want16) + (
        [f"{unwritten} NaN"] if unwritten else [])
    for name, backend in SDPA_BACKENDS.items():
        try:
            _, got = torch_backward(backend, q16, k16, v16, grad16, scale)
            result[f"bf16 {name}"] = [rel(g, w) for g, w in zip(got, want16)]
        except RuntimeError as error:
            result[f"bf16 {name}"] = repr(error)[:120]
    return result


def head_dims_timings(batch, seq_len, num_heads, head_dim):
    """[(variant, ms)] at `batch`: rows + cols (ours) or the whole backward (SDPA)."""
    q, k, v, grad_attn, probs, lse, attn_output = head_dim_inputs(batch, seq_len, num_heads,
                                                                  head_dim, seed=0)
    scale = 1 / math.sqrt(head_dim)
    table = []
    operands = halves_of(grad_attn, q, k, v)
    for mode, p_or_lse, out in (("P given", probs, None), ("recompute", lse, attn_output)):
        rows, cols, _ = gluon_passes(p_or_lse, operands, out, scale, head_dim,
                                     products=Products.BF16X3)
        rows()
        table.append((f"f32 high gluon {mode}", bench_ms(rows) + bench_ms(cols)))
        p_or_lse_given = given(p_or_lse, out)
        _, _, delta, _ = softmax_bwd.launch_rows(grad_attn, q, k, v, out, scale,
                                                 **p_or_lse_given)
        table.append((f"f32 high triton {mode}", bench_ms(
            lambda: softmax_bwd.launch_rows(  # noqa: B023
                grad_attn, q, k, v, out, scale, **p_or_lse_given))  # noqa: B023
            + bench_ms(lambda: softmax_bwd.launch_cols(  # noqa: B023
                grad_attn, q, k, v, delta, scale, **p_or_lse_given))))  # noqa: B023
    backward, _ = torch_backward(SDPBackend.EFFICIENT_ATTENTION, q, k, v, grad_attn, scale)
    table.append(("f32 sdpa efficient (autograd)", bench_ms(backward)))
    del probs, operands
    q16, k16, v16, grad16 = (t.bfloat16() for t in (q, k, v, grad_attn))
    rows, cols, _ = gluon_passes(lse, [t for t in (grad16, q16, k16, v16) for _ in (0, 1)],
                                 attn_output.bfloat16(), scale, head_dim,
                                 products=Products.ONE_BF16)
    rows()
    table.append(("bf16 gluon recompute", bench_ms(rows) + bench_ms(cols)))
    for name, backend in SDPA_BACKENDS.items():
        try:
            backward, _ = torch_backward(backend, q16, k16, v16, grad16, scale)
            table.append((f"bf16 {name} (autograd)", bench_ms(backward)))
        except RuntimeError as error:
            table.append((f"bf16 {name}: {repr(error)[:60]}", float("nan")))
    return table


def run_core_head_dims(args, record):
    report = {"batch": args.batch}
    rows = []
    for name, seq_len, num_heads, head_dim in SHAPES:
        try:                          # a failing shape is reported, the others still run
            check = head_dims_float64_check(seq_len, num_heads, head_dim)
        except Exception as error:
            check = {"failed": repr(error)[:300]}
        entry = {"float64 check, batch 2 (dQ, dK, dV rel. error)": check}
        print(json.dumps({name: entry}), flush=True)
        work = 5 * 2 * args.batch * num_heads * seq_len * seq_len * head_dim
        try:
            measured = head_dims_timings(args.batch, seq_len, num_heads, head_dim)
        except Exception as error:
            measured = [(f"failed: {repr(error)[:200]}", float("nan"))]
        shape = f"{name} ({seq_len}x{num_heads}x{head_dim})"
        for variant, ms in measured:
            rows.append((shape, variant, ms, work / (ms * 1e9)))
            record(f"core at head dim {head_dim}: {variant}", args.batch, shape, ms)
        entry["timings (variant, ms, TFLOP/s)"] = [r[1:] for r in rows if r[0] == shape]
        report[name] = entry
    print("float64 check, batch 2: largest relative error of dQ, dK, dV (bf16x3 ~1e-5, "
          "bf16 one product ~3e-3; a note where outputs were left unwritten)")
    for name, *_ in SHAPES:
        for variant, errors in report[name][
                "float64 check, batch 2 (dQ, dK, dV rel. error)"].items():
            numbers = [e for e in errors if isinstance(e, float)] if isinstance(
                errors, list) else []
            note = " ".join(e for e in errors if isinstance(e, str)) if isinstance(
                errors, list) else errors
            worst = f"{max(numbers):9.2e}" if numbers else f"{'-':>9}"
            print(f"{name:16} {variant:28} {worst} {note}")
    print(f"batch {args.batch}: rows + cols (ours) or the whole backward (sdpa), ms median, "
          f"L2 flushed; TFLOP/s of 5 x 2BHS^2D")
    for shape, variant, ms, tflops in rows:
        print(f"{shape:28} {variant:36} {ms:8.3f} {tflops:7.1f}")
    return report


# ------------------------------------------------------------------------- core_ws

def walk_spills(sass):
    """Local-memory loads and stores (spills) in the SASS loop around the first HGMMA:
    the consumers' walk over a work item's query tiles, the kernel's innermost loop."""
    lines = [(int(m[1], 16), m[2]) for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    first_product = next(address for address, text in lines if "HGMMA" in text)
    loops = [(int(target, 16), address) for address, text in lines
             for target in re.findall(r"\bBRA (?:`\()?0x([0-9a-f]+)", text)
             if int(target, 16) <= first_product <= address]
    start, end = min(loops, key=lambda loop: loop[1] - loop[0])
    return sum(1 for address, text in lines
               if start <= address <= end and re.search(r"\b(?:STL|LDL)\b", text))


def ws_resources(compiled):
    """{shared_bytes, threads, spill_stores, walk_spills, hgmma, waits, setmaxnreg,
    serialized, cp_async_copies, cp_async_arrives} of a warp-specialized kernel compiled
    for sm_90 (triton's CompiledKernel): what ptxas reports and the SASS shows, and the
    PTX's cp.async copies and its arrivals on an mbarrier when they land."""
    from kernel_resources import ptxas_report_and_sass
    notes, sass = ptxas_report_and_sass(compiled)
    return dict(
        shared_bytes=compiled.metadata.shared,
        threads=int(re.search(r"\.reqntid (\d+)", compiled.asm["ptx"])[1]),
        spill_stores=int(re.search(r"(\d+) bytes spill stores", notes)[1]),
        walk_spills=walk_spills(sass),
        hgmma=len(re.findall(r"\bHGMMA\b", sass)),
        waits=len(re.findall(r"WARPGROUP\.DEPBAR", sass)),
        setmaxnreg=sorted({int(n) for n in re.findall(
            r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])}),
        serialized=re.findall(r"\(C75\d\d\)[^\n]*", notes),
        cp_async_copies=len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global",
                                       compiled.asm["ptx"])),
        cp_async_arrives=len(re.findall(r"\bcp\.async\.mbarrier\.arrive",
                                        compiled.asm["ptx"])))


def ws_sm90_report():
    """[(tiles, ws_resources)] of each configuration compiled for sm_90."""
    return [(list(tiles), ws_resources(attention_bwd_ws.compile_sm90(tiles)))
            for tiles in attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES]


def sdpa_raw(q, k, v, grad_attn):
    """{name: (backward closure, (dQ, dK, dV) merged [B,S,E])} of SDPA's raw flash and
    cuDNN backward operators, each from its own forward; an error string where an
    operator does not run."""
    grad_out = grad_attn.view(q.shape[0], S, H, D).transpose(1, 2)
    result = {}
    try:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=SCALE)

        def flash():
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False,
                seed, offset, scale=SCALE)
        result["sdpa flash bwd (raw)"] = flash, [merge_heads(g) for g in flash()]
    except RuntimeError as error:
        result["sdpa flash bwd (raw)"] = repr(error)[:120]
    try:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
            torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True,
                                                               scale=SCALE)
        no_bias = torch.empty(0, device=q.device, dtype=q.dtype)

        def cudnn():
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                grad_out, q, k, v, out, lse, seed, offset, no_bias, cum_q, cum_k,
                max_q, max_k, 0.0, False, scale=SCALE)
        result["sdpa cudnn bwd (raw)"] = cudnn, [merge_heads(g) for g in cudnn()]
    except RuntimeError as error:
        try:                   # the raw operator refused: time SDPA's own backward
            backward, grads = torch_backward(SDPBackend.CUDNN_ATTENTION, q, k, v,
                                             grad_attn)
            result["sdpa cudnn bwd (autograd)"] = backward, grads
        except RuntimeError as error2:
            result["sdpa cudnn bwd (raw)"] = repr(error)[:60] + repr(error2)[:60]
    return result


def ws_forwards(q, k, v, table, flops):
    """The deterministic attention's forward choices (deterministic_sdpa.py): torch's
    flash forward, and cuDNN's with its log-sum-exp, timed; how far cuDNN's output and
    lse are from flash's; whether cuDNN's runs under the deterministic flag."""
    flash = lambda: torch.ops.aten._scaled_dot_product_flash_attention(  # noqa: E731
        q, k, v, scale=SCALE)[:2]
    cudnn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
        q, k, v, None, True, scale=SCALE)[:2]
    checks, outputs = {}, {}
    for name, forward in (("sdpa flash fwd (raw)", flash), ("sdpa cudnn fwd (raw)", cudnn)):
        try:
            outputs[name] = forward()
            ms = bench_ms(forward)                         # two products of five
            table.append((name, "-", ms, flops * 2 / 5 / ms / 1e9))
        except RuntimeError as error:
            checks[name] = repr(error)[:200]
    if len(outputs) == 2:
        (flash_out, flash_lse), (cudnn_out, cudnn_lse) = outputs.values()
        checks["cudnn vs flash: out max abs diff"] = (
            cudnn_out.float() - flash_out.float()).abs().max().item()
        checks["cudnn vs flash: lse max abs diff, lse shape"] = [
            (cudnn_lse.reshape(flash_lse.shape) - flash_lse).abs().max().item(),
            list(cudnn_lse.shape)]
        was = (torch.are_deterministic_algorithms_enabled(),
               torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True)
        try:
            cudnn()
            checks["cudnn fwd under the deterministic flag"] = "runs"
        except RuntimeError as error:
            checks["cudnn fwd under the deterministic flag"] = repr(error)[:200]
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    return checks


def ws_delta_kernels(grad_attn, attn_output, lse, q, k, v, table, flops):
    """Each delta kernel configuration (DELTA_TILES, DELTA_CANDIDATE_TILES) timed alone
    and with the main kernel at FASTEST_TILES; whether its outputs (delta, the base-2
    lse, the zeroed semaphores) are bitwise DELTA_TILES'."""
    fastest = attention_bwd_ws.FASTEST_TILES
    expected = attention_bwd_ws.launch_delta(grad_attn, attn_output, lse, H, fastest.block_m)
    checks = {}
    for delta_tiles in (attention_bwd_ws.DELTA_TILES,
                        *attention_bwd_ws.DELTA_CANDIDATE_TILES):
        try:
            got = attention_bwd_ws.launch_delta(grad_attn, attn_output, lse, H,
                                                fastest.block_m, delta_tiles)
            checks[str(tuple(delta_tiles))] = dict(
                bitwise_delta_tiles=all(torch.equal(a, g) for a, g in zip(expected, got)),
                semaphores_zero=bool((got[2] == 0).all()))
            ms = bench_ms(lambda: attention_bwd_ws.launch_delta(  # noqa: B023
                grad_attn, attn_output, lse, H, fastest.block_m, delta_tiles))
            table.append(("ws delta kernel alone", tuple(delta_tiles), ms, float("nan")))
            ms = bench_ms(lambda: attention_bwd_ws.launch(  # noqa: B023
                q, k, v, grad_attn, attn_output, lse, SCALE, fastest,
                delta_tiles=delta_tiles))
            table.append(("ws, this delta kernel", tuple(delta_tiles), ms, flops / ms / 1e9))
        except Exception as error:      # report and go on to the next configuration
            checks[str(tuple(delta_tiles))] = repr(error)[:300]
    print(json.dumps({"delta kernels": checks}), flush=True)
    return checks


def run_core_ws(args, record):
    """At batch 1 and --batch, bf16: each configuration of attention_bwd_ws.TILES and
    CANDIDATE_TILES against float64 (P recomputed from the same lse), beside the current
    Gluon kernels and SDPA's raw backwards; bitwise over 3 calls and between the QKV
    views and contiguous copies (each configuration's first calls under a 120 s
    deadline: exit status 3, "HANG"). At --batch: the times."""
    if args.sm90:
        print(json.dumps(ws_sm90_report()))
        return None
    batch = args.batch
    flops = 5 * 2 * batch * H * S * S * D
    report, table = {}, []
    for b in dict.fromkeys((1, batch)):
        q, k, v, grad_attn, attn_output, lse = half_inputs(b, torch.bfloat16, seed=b)
        if b == batch:
            report[f"batch {b}: forwards"] = ws_forwards(q, k, v, table, flops)
            print(json.dumps(report[f"batch {b}: forwards"]), flush=True)
        ref = softmax_bwd.attention_backward_math(
            *(t.double() for t in (grad_attn, q, k, v)), SCALE, lse=lse.double())
        checks, outputs = {}, {}
        contiguous = [t.contiguous() for t in (q, k, v)]
        for tiles in attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES:
            name = f"ws {tuple(tiles)}"

            def run(q=q, k=k, v=v, tiles=tiles):
                return attention_bwd_ws.launch(q, k, v, grad_attn, attn_output,  # noqa: B023
                                               lse, SCALE, tiles).chunk(3, dim=-1)  # noqa: B023
            try:
                with harness.deadline(120, f"{name} at batch {b} (compile and 5 calls)"):
                    got = run()
                    again = [run() for _ in range(3)]
                    from_copies = run(*contiguous)
                    torch.cuda.synchronize()
                outputs[name] = got
                checks[name] = dict(
                    vs_float64=[rel(g, r) for g, r in zip(got, ref)],
                    bitwise_3_calls=all(torch.equal(a, g) for call in again
                                        for a, g in zip(call, got)),
                    bitwise_views_vs_contiguous=all(
                        torch.equal(a, g) for a, g in zip(from_copies, got)))
                print(json.dumps({f"batch {b}, {name}": checks[name]}), flush=True)
                if b == batch:
                    ms = bench_ms(run)
                    table.append(("ws one pass", tuple(tiles), ms, flops / ms / 1e9))
            except Exception as error:      # report and go on to the next configuration
                checks[name] = repr(error)[:300]
                print(json.dumps({f"batch {b}, {name}": checks[name]}), flush=True)
        if b == batch:
            checks["delta kernels"] = ws_delta_kernels(grad_attn, attn_output, lse, q, k, v,
                                                       table, flops)
        try:                                 # softmax_bwd_gluon's kernels, as they are today
            (rows, cols), current = half_passes(q, k, v, grad_attn, attn_output, lse,
                                                softmax_bwd_gluon.ROWS_TILES[0],
                                                softmax_bwd_gluon.COLS_TILES[0])
            rows()
            cols()
            current = (current[0], *current[1].chunk(2, dim=-1))
            checks["current gluon rows+cols"] = [rel(g, r) for g, r in zip(current, ref)]
            for name, got in outputs.items():
                checks[name]["vs_current"] = [rel(g, c) for g, c in zip(got, current)]
            if b == batch:
                ms = bench_ms(lambda: (rows(), cols()))  # noqa: B023
                table.append(("current gluon rows+cols", "-", ms, flops / ms / 1e9))
        except Exception as error:
            checks["current gluon rows+cols"] = repr(error)[:300]
        for name, entry in sdpa_raw(q, k, v, grad_attn).items():
            checks[name] = entry if isinstance(entry, str) else [
                rel(g, r) for g, r in zip(entry[1], ref)]
            if b == batch and not isinstance(entry, str):
                ms = bench_ms(entry[0])
                table.append((name, "-", ms, flops / ms / 1e9))
        report[f"batch {b}: dQ, dK, dV rel. error"] = checks
        print(json.dumps({f"batch {b}": checks}), flush=True)
        del ref, outputs
        torch.cuda.empty_cache()
    report["table"] = table
    print(f"batch {batch}, bf16, S {S}, H {H}, D {D}: ms (median, L2 flushed); TFLOP/s of "
          f"5 products")
    for name, tiles, ms, tflops in table:
        print(f"{name:28} {tiles!s:22} {ms:7.3f} {tflops:7.1f}")
        record(f"core {name}", batch, f"bf16, tiles {tiles}", ms)
    return report


# ---------------------------------------------------------------------- layer_norm

LN_EPS = 1e-5
LN_CANDIDATES = [LayerNormTiles(r, c, w) for r, c, w in (
    (4, 4, 8), (2, 2, 4), (2, 8, 4), (4, 8, 8), (2, 16, 4), (4, 16, 8), (8, 4, 8))]


def layer_norm_inputs(batch, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    x = randn(batch, S, E) * 2 + 0.5
    return (randn(batch, S, E), *(randn(batch * S, E) for _ in range(4)),
            torch.tensor(0.5, device="cuda"), x, x.mean(-1, keepdim=True),
            x.var(-1, unbiased=False, keepdim=True), randn(E))


def inductor_math(grad_output, p0, p1, p2, p3, unscale, x, x_mean, x_var, ln_weight):
    """The graph's math before the fused kernel (the four GEMM outputs added, the row
    math, the sums over rows)."""
    grad_x_norm = (((p0 + p1) + (p2 + p3)) * unscale).view(x.shape)
    grad_x, grad_ln_weight, grad_ln_bias = layer_norm_bwd.layer_norm_backward(
        grad_output, grad_x_norm, x, x_mean, x_var, ln_weight, LN_EPS, "contract")
    return grad_x, torch.stack([grad_ln_weight, grad_ln_bias, grad_output.sum((0, 1))])


def max_rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def run_layer_norm(args, record):
    compiled_math = torch.compile(inductor_math, dynamic=False)
    compiled_fused = torch.compile(
        lambda *t: layer_norm_bwd.fused_layer_norm_backward(*t, LN_EPS, False), dynamic=True)
    table = []
    for batch in args.batch_sizes or (1, 8, 32):
        inputs = layer_norm_inputs(batch)
        want = [t.double() for t in inductor_math(*(t.double() for t in inputs))]
        got = compiled_math(*inputs)
        table.append((batch, "inductor (old graph)",
                      bench_ms(lambda: compiled_math(*inputs)),  # noqa: B023
                      max_rel(got[0], want[0]), max_rel(got[1], want[1])))
        got = compiled_fused(*inputs)
        table.append((batch, f"fused, compiled {tuple(layer_norm_bwd.TILES)}",
                      bench_ms(lambda: compiled_fused(*inputs)),  # noqa: B023
                      max_rel(got[0], want[0]), max_rel(torch.stack(got[1:]), want[1])))
        for tiles in LN_CANDIDATES:
            grad_x, partial = layer_norm_bwd.launch(*inputs, LN_EPS, False, tiles)
            errors = max_rel(grad_x, want[0]), max_rel(partial.sum(1), want[1])
            table.append((batch, f"fused {tuple(tiles)}",
                          bench_ms(lambda: layer_norm_bwd.launch(  # noqa: B023
                              *inputs, LN_EPS, False, tiles)), *errors))  # noqa: B023
            # with the sums of its partials ([3, programs, E]: more rows per program,
            # fewer of them)
            table.append((batch, f"fused {tuple(tiles)} + partials summed",
                          bench_ms(lambda: layer_norm_bwd.launch(  # noqa: B023
                              *inputs, LN_EPS, False, tiles)[1].sum(1)), *errors))  # noqa: B023
    print(f"{'batch':>5} {'variant':48} {'ms':>7} {'grad_x err':>10} {'sums err':>9}")
    for batch, name, ms, err_x, err_sums in table:
        print(f"{batch:5} {name:48} {ms:7.4f} {err_x:10.1e} {err_sums:9.1e}")
        record(f"LayerNorm backward {name}", batch, "float32", ms)
    return table


# ------------------------------------------------------------------------ contract

def group_of(name):
    """The kind of a CUDA kernel, from its name."""
    lower = name.lower()
    for attention_pass in ("rows", "cols"):               # our templates, Gluon kernels
        if f"softmax_bwd_{attention_pass}" in name and (
                name.startswith("triton_tem_") or name.endswith("_kernel")):
            return f"attention core: {attention_pass} pass"
    if name.startswith("layer_norm_bwd_kernel"):
        return "LayerNorm backward and sums over rows (fused kernel)"
    if name.startswith("attention_fwd_kernel"):
        return "attention forward"
    if any(fragment in lower for fragment in ("nvjet", "gemm", "cutlass")):
        return "GEMMs"
    if "flash" in lower or "fmha" in lower:
        return "torch's attention (flash / cuDNN)"
    if "multi_tensor_apply" in name or "memcpy" in lower:
        return "CUDA-graph input and output copies"
    if name.startswith("triton_"):
        return "Inductor's fused kernels (splits, copies, sums)"
    if "CUDAFunctor_add" in name:
        return "autograd's gradient accumulation"
    return "other"


def run_contract(args, record):
    """GPU time per kernel and per kind of kernel of one call (5 profiled calls)."""
    from torch.profiler import ProfilerActivity, profile
    torch.set_float32_matmul_precision(args.float32_precision)
    if args.module:
        step = harness.module_step(args.batch, args.autocast, args.stock)
    else:
        inputs = tuple(contract_inputs(args.batch, device="cuda").values())
        step = lambda: contract.run(*inputs)                          # noqa: E731
    calls = 5
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=90))
    groups, kernels = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            groups[group_of(event.name)] += event.device_time / 1e3 / calls
            kernels[(group_of(event.name), event.name)] += event.device_time / 1e3 / calls
    print("| group | kernel | ms per call |\n|---|---|---|")
    for (group, name), ms in kernels.most_common():
        print(f"| {group} | {name[:160]} | {ms:.4f} |")
    print("| group | ms per call |\n|---|---|")
    what = "module step" if args.module else "contract"
    setting = ("stock " if args.stock else "") + ("autocast" if args.autocast else
                                                   f"float32 {args.float32_precision}")
    for group, ms in groups.most_common():
        print(f"| {group} | {ms:.3f} |")
        record(f"{what} GPU time: {group}", args.batch, setting, ms)
    busy = sum(groups.values())
    print(f"| busy | {busy:.3f} |")
    record(f"{what} GPU busy", args.batch, setting, busy)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return {"groups": dict(groups), "busy": busy}


# -------------------------------------------------------------------------- margin

MARGIN_VECTORS = ("grad_ln_weight", "grad_ln_bias", "grad_out_bias")   # 1,024 elements each


def run_margin(args, record):
    """harness.contract_margins at each batch, with the autotune choices Inductor timed
    for it (a batch that recompiles, as 420 does after 32, tunes again). Memory at batch
    1,850: the inputs are 70 GB (P alone 39 GB) in float32."""
    from vitattn_bwd.inductor import recorded_autotune_choices
    torch.backends.cuda.matmul.allow_tf32 = False     # the reference's own products
    results = []
    for batch in args.batch_sizes or (32, 56, 420, 1850):
        with recorded_autotune_choices() as choices:
            margins = harness.contract_margins(batch, args.seed, args.precision)
        results.append(dict(batch=batch, margins=margins, autotune=choices))
        torch.cuda.empty_cache()
        print(f"\nbatch {batch} (K of the weight gradients = B*S = {batch * S:,})")
        print(f"  {'output':16} {'matched':>9} {'misses':>7} {'rel error':>10} {'ref rms':>10}")
        for name, m in margins.items():
            print(f"  {name:16} {m['matched']:9.5f} {m['misses']:7d} "
                  f"{m['relative_error']:10.2e} {m['ref_rms']:10.3g}")
            record(f"contract matched fraction {name}", batch, f"float32 {args.precision}",
                   m["matched"], unit="fraction")
        for name, sizes, winner, timings in choices:
            best = min(timings.values(), default=float("nan"))
            print(f"  autotune {name} {sizes}: {winner} ({len(timings)} candidates, "
                  f"best {best:.3f} ms)")
    print("\nbatch  worst matched  (output)   vector misses (ln_weight, ln_bias, out_bias)")
    for result in results:
        name, worst = min(result["margins"].items(), key=lambda item: item[1]["matched"])
        vector = [result["margins"][v]["misses"] for v in MARGIN_VECTORS]
        print(f"{result['batch']:5d}  {worst['matched']:.5f}  ({name})  {vector}")
    return results


# --------------------------------------------------------------------------- main

RUNS = {"attention_fwd": run_attention_fwd, "core_gluon": run_core_gluon,
        "core_half": run_core_half, "core_head_dims": run_core_head_dims,
        "core_ws": run_core_ws, "layer_norm": run_layer_norm, "contract": run_contract,
        "margin": run_margin}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", required=True, choices=KERNELS)
    parser.add_argument("--batch", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--batch-sizes", type=int, nargs="+",
                        help="attention_fwd, layer_norm, margin (default: the kernel's)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-record", action="store_true",
                        help="do not append the timings to results/runs.csv")
    parser.add_argument("--sweep", action="store_true", help="attention_fwd: tile sweep")
    parser.add_argument("--sweep-head-dims", type=int, nargs="+", default=[64, 128, 32])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"],
                        help="core_half")
    parser.add_argument("--sm90", action="store_true", help="core_ws: compile for sm_90 "
                        "and print its resources as one JSON line (no GPU needed)")
    parser.add_argument("--module", action="store_true", help="contract: a "
                        "VisionAttentionBlock fwd+bwd step instead of the contract call")
    parser.add_argument("--autocast", action="store_true",
                        help="contract --module: the forward under torch.autocast(bfloat16)")
    parser.add_argument("--stock", action="store_true",
                        help="contract --module: the stock block instead of ours")
    parser.add_argument("--float32-precision", choices=("highest", "high"),
                        default="highest", help="contract: torch's float32 matmul "
                        "precision for the run (the block follows it; \"high\": TF32 for "
                        "--stock), default %(default)s")
    parser.add_argument("--rows", type=int, default=25, help="contract: kernels listed")
    parser.add_argument("--trace", type=Path, help="contract: a chrome trace file")
    parser.add_argument("--seed", type=int, default=0, help="margin")
    parser.add_argument("--precision", default="high", choices=("high", "highest"),
                        help="margin")
    args = parser.parse_args(argv)
    if not args.sm90 and not torch.cuda.is_available():
        sys.exit("time_kernels.py needs a CUDA GPU (--kernel core_ws --sm90 does not)")
    command = "python3 scripts/time_kernels.py " + " ".join(argv or sys.argv[1:])
    rows = []

    def record(what, batch, setting, figure, unit="ms"):
        rows.append(dict(what=what, batch=batch, setting=setting, figure=f"{figure:.6g}",
                         unit=unit, command=command))
    report = RUNS[args.kernel](args, record)
    if report is not None:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"{args.kernel}.json").write_text(
            json.dumps(report, indent=1, default=str))
    if rows and not args.no_record:
        harness.append_results(rows)


if __name__ == "__main__":
    main()
