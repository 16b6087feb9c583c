"""The attention core's one-product Gluon kernels (bf16 / fp16 operands, P recomputed
from the log-sum-exp: VisionAttentionBlock under autocast) against torch's own attention
backwards at the same shape, checked and timed in one call on the GPU.

    PYTHONPATH=. python3 scripts/time_core_half.py [--batch 32] [--out DIR]
                                                   [--dtypes bfloat16 float16]

q, k and v are the head views of one QKV projection [B,S,3E], as the block saves them
(the kernels read them where they lie, row stride 3E). The forward of the inputs is
torch's FlashAttention (aten._scaled_dot_product_flash_attention: its output and
natural-log log-sum-exp), as the block's half-precision forward runs it. Checked at
batch 2 against float64: our dQ, dK, dV and those of torch's flash, cuDNN and
memory-efficient backwards; our outputs from the views bitwise against those from
contiguous copies; cuDNN's forward (output, log-sum-exp) against flash's. Timed at
--batch (median of do_bench, L2 flushed): our rows and cols passes per tile config in
gluon_core and CANDIDATE_TILES, torch's backwards (each from its own forward's outputs)
and the flash and cuDNN forwards. Prints a table last; details in DIR/core_half.json.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from time_core_gluon import D, E, H, S, bench, rel  # noqa: E402  (beside this script)
from vitattn_bwd import attention_core, gluon_core  # noqa: E402
from vitattn_bwd.attention_core import TileConfig  # noqa: E402
from vitattn_bwd.attention_fwd import attention_fwd_half  # noqa: E402
from vitattn_bwd.layout import merge_heads, split_heads  # noqa: E402

SCALE = 1 / math.sqrt(D)
# tiles timed beside gluon_core's (each compiles for sm_90 without spills at one product:
# scripts/kernel_resources.py)
CANDIDATE_TILES = {"rows": (TileConfig(64, 32, 4, 3), TileConfig(128, 32, 8, 2),
                            TileConfig(128, 64, 8, 2)),
                   "cols": (TileConfig(32, 64, 4, 2), TileConfig(16, 64, 4, 3),
                            TileConfig(32, 128, 8, 2), TileConfig(32, 128, 8, 3))}


def make_inputs(batch, dtype, seed=0):
    """q, k, v [B,H,S,D] as views of one qkv [B,S,3E], grad_attn, the attention output
    [B,S,E] and the log-sum-exp, in `dtype` (the log-sum-exp float32)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, S, 3 * E, device="cuda", generator=g).to(dtype)
    q, k, v = (split_heads(t, H) for t in qkv.chunk(3, dim=-1))
    grad_attn = torch.randn(batch, S, E, device="cuda", generator=g).to(dtype)
    attn_output, lse = attention_fwd_half(q, k, v, SCALE)      # the block's own forward
    return q, k, v, grad_attn, attn_output.contiguous(), lse


def ours(q, k, v, grad_attn, attn_output, lse, rows_tiles, cols_tiles):
    """(rows, cols) launch closures and their outputs (grad_q [B,S,E], grad_kv [B,S,2E]
    in q's dtype)."""
    batch = q.shape[0]
    groups = attention_core.sum_groups(S)
    delta = torch.empty(batch, H, S, device="cuda")
    grad_q = torch.full((batch, S, E), float("nan"), device="cuda", dtype=q.dtype)
    grad_kv = torch.full((batch, S, 2 * E), float("nan"), device="cuda", dtype=q.dtype)
    grad_q_sums = torch.empty(batch, groups, E, device="cuda")
    grad_kv_sums = torch.empty(batch, groups, 2 * E, device="cuda")
    unused = grad_q_sums                          # the halves of float32 operands
    operands = (grad_attn, grad_attn, q, q, k, k, v, v)

    def rows():
        gluon_core.launch_rows(lse, *operands, attn_output, delta, unused, grad_q_sums,
                               grad_q, SCALE, rows_tiles, products=1, prefetch=0)

    def cols():
        gluon_core.launch_cols(lse, *operands, delta, unused, grad_kv_sums, grad_kv, SCALE,
                               cols_tiles, products=1, prefetch=0)
    return (rows, cols), (grad_q, grad_kv, delta, grad_q_sums, grad_kv_sums)


def torch_backward(backend, q, k, v, grad_attn):
    """(backward closure, (dQ, dK, dV) merged [B,S,E]) of F.scaled_dot_product_attention
    with one backend."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=SCALE)
    grad_out = grad_attn.view(q.shape[0], S, H, D).transpose(1, 2)

    def backward():
        return torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    return backward, [merge_heads(g) for g in backward()]


def cudnn_forward(q, k, v, scale):
    """cuDNN's attention forward: output [B,S,E] and log-sum-exp [B,H,S]."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, scale=scale)[:2]
    return merge_heads(out), lse.reshape(q.shape[:3])


BACKENDS = {"torch flash": SDPBackend.FLASH_ATTENTION, "torch cudnn": SDPBackend.CUDNN_ATTENTION,
            "torch efficient": SDPBackend.EFFICIENT_ATTENTION}


def float64_check(dtype):
    q, k, v, grad_attn, out, lse = make_inputs(2, dtype, seed=1)
    ref = attention_core.attention_backward_math(
        *(t.double() for t in (attention_core.probabilities(
            lse.double(), q.double(), k.double(), SCALE), grad_attn, q, k, v)), SCALE)
    lse_check = rel(lse, torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * SCALE,
                                         -1))
    (rows, cols), got = ours(q, k, v, grad_attn, out, lse, gluon_core.ROWS_TILES[0],
                             gluon_core.COLS_TILES[0])
    rows()
    cols()
    (rows, cols), from_copies = ours(*(t.contiguous() for t in (q, k, v)), grad_attn, out,
                                     lse, gluon_core.ROWS_TILES[0], gluon_core.COLS_TILES[0])
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    args = parser.parse_args()
    report = {}
    table = []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        name = str(dtype).removeprefix("torch.")
        report[f"float64 check {name}, batch 2 (dQ, dK, dV rel. error)"] = float64_check(dtype)
        print(json.dumps(report), flush=True)
        q, k, v, grad_attn, out, lse = make_inputs(args.batch, dtype)
        for rows_tiles in gluon_core.ROWS_TILES + CANDIDATE_TILES["rows"]:
            (rows, _), _ = ours(q, k, v, grad_attn, out, lse, rows_tiles, rows_tiles)
            table.append((name, "ours rows", tuple(rows_tiles), bench(rows)))
        for cols_tiles in gluon_core.COLS_TILES + CANDIDATE_TILES["cols"]:
            (rows, cols), _ = ours(q, k, v, grad_attn, out, lse, gluon_core.ROWS_TILES[0],
                                   cols_tiles)
            rows()
            table.append((name, "ours cols", tuple(cols_tiles), bench(cols)))
        for forward_name, forward in (("flash forward", attention_fwd_half),
                                      ("cudnn forward", cudnn_forward)):
            table.append((name, forward_name, "-", bench(lambda: forward(q, k, v, SCALE))))
        for backend_name, backend in BACKENDS.items():
            try:
                backward, _ = torch_backward(backend, q, k, v, grad_attn)
                table.append((name, backend_name, "-", bench(backward)))
            except RuntimeError as error:
                table.append((name, backend_name, repr(error)[:60], float("nan")))
    report["batch"] = args.batch
    report["table"] = table
    Path(args.out, "core_half.json").write_text(json.dumps(report, indent=1))
    print(f"batch {args.batch}: ms (median, L2 flushed)")
    for dtype, kernel, tiles, ms in table:
        print(f"{dtype:9} {kernel:16} {tiles!s:18} {ms:7.3f}")


if __name__ == "__main__":
    main()
