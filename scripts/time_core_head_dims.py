"""The attention core's raw kernels at the head dims of the towers people train, against
float64 and against SDPA's backward, checked and timed in one call on the GPU.

    PYTHONPATH=. python3 scripts/time_core_head_dims.py [--batch 32] [--out DIR]

Shapes (SHAPES): ViT-L/14-336 (577 tokens x 16 heads x 64, the measured baseline),
SigLIP so400m (729 x 16 x 72) and OpenCLIP ViT-H/14 (257 x 16 x 80). Head dims that
are not powers of two run in zero-padded tiles of the next power of two (128 for 72 and
80). Per shape:

- float64 check at batch 2 (relative error of dQ, dK, dV): float32 "high" (bf16x3, three
  products per matmul) through the Gluon kernels (gluon_core, P given and recomputed
  from the log-sum-exp) and the Triton kernels (attention_core's eager launchers), every
  output element written (NaN-poisoned buffers); bf16 one-product mode through the Gluon
  kernels, beside SDPA's cuDNN and flash backwards on the same bf16 inputs.
- timing at --batch (median of triton.testing.do_bench, L2 flushed), rows + cols:
  float32 "high" Gluon and Triton (the Triton launchers include their operand split)
  against SDPA's float32 backward (autograd, its efficient-attention kernel); bf16 one
  product (P recomputed: the module's mode) against SDPA's cuDNN and flash backwards.
  TFLOP/s counts 5 products of 2*B*H*S^2*D (the one-product core's work; the three-
  product kernels do three times that in bf16 products).

Prints a table last; details in DIR/core_head_dims.json.
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

from vitattn_bwd import attention_core, gluon_core  # noqa: E402
from vitattn_bwd.layout import merge_heads, split_heads  # noqa: E402

from time_core_gluon import bench, halves_of, rel  # noqa: E402  (beside this script)

SHAPES = [("ViT-L/14-336", 577, 16, 64), ("SigLIP so400m", 729, 16, 72),
          ("ViT-H/14", 257, 16, 80)]
SDPA_BACKENDS = {"sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION}


def make_inputs(batch, S, H, D, seed):
    """float32 q, k, v [B,H,S,D], grad_attn [B,S,E], P [B,H,S,S], its log-sum-exp
    [B,H,S] and the attention output O [B,S,E] (P v), from float32 math."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, H, S, D, device="cuda", generator=g) for _ in range(3))
    grad_attn = torch.randn(batch, S, H * D, device="cuda", generator=g)
    logits = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D))
    probs = torch.softmax(logits, -1)
    return q, k, v, grad_attn, probs, torch.logsumexp(logits, -1), merge_heads(probs @ v)


def gluon_passes(probs, operands, attn_output, scale, head_dim, products):
    """(rows, cols) launch closures of the Gluon kernels and their NaN-poisoned outputs
    (grad_q, grad_kv, delta: float32 [B,S,E], [B,S,2E], [B,H,S]). operands: the eight
    (grad_attn, q, k, v) hi / lo tensors; products 3 (bf16 halves) or 1 (bf16, lo = hi)."""
    batch, num_heads, seq_len, _ = operands[2].shape
    E = num_heads * head_dim
    nan = dict(device="cuda", fill_value=float("nan"))
    gradient = torch.float16 if products == 3 else operands[0].dtype
    halves = 2 if products == 3 else 0
    delta = torch.full((batch, num_heads, seq_len), **nan)
    grad_q16 = torch.full((batch, seq_len, E), dtype=gradient, **nan)
    grad_q_halves = torch.full((batch, seq_len, halves * E), dtype=torch.bfloat16, **nan)
    grad_kv16 = torch.full((batch, seq_len, 2 * E), dtype=gradient, **nan)
    grad_kv_halves = torch.full((batch, seq_len, 2 * halves * E), dtype=torch.bfloat16,
                                **nan)
    groups = attention_core.sum_groups(seq_len)
    grad_q_sums = torch.full((batch, groups, E), **nan)
    grad_kv_sums = torch.full((batch, groups, 2 * E), **nan)
    placeholder = probs if attn_output is None else attn_output
    rows_tiles, cols_tiles = gluon_core.rows_tiles(head_dim)[0], gluon_core.cols_tiles(head_dim)[0]
    prefetch = {} if probs.dim() == 4 else dict(prefetch=0)

    def rows():
        gluon_core.launch_rows(probs, *operands, placeholder, delta, grad_q_halves,
                               grad_q_sums, grad_q16, scale, rows_tiles, products, **prefetch)

    def cols():
        gluon_core.launch_cols(probs, *operands, delta, grad_kv_halves, grad_kv_sums,
                               grad_kv16, scale, cols_tiles, products, **prefetch)

    def grads():
        if products == 3:
            return (attention_core.float32_from_halves(grad_q_halves),
                    attention_core.float32_from_halves(grad_kv_halves), delta,
                    grad_q16, grad_kv16, grad_q_sums, grad_kv_sums)
        return (grad_q16.float(), grad_kv16.float(), delta, grad_q_sums, grad_kv_sums)
    return rows, cols, grads


def sdpa_backward(backend, q, k, v, grad_attn, scale):
    """(backward closure, its dQ, dK, dV [B,S,E]) of F.scaled_dot_product_attention with
    one backend."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    grad_out = split_heads(grad_attn, q.shape[1])

    def backward():
        return torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    return backward, [merge_heads(g) for g in backward()]


def errors_of(grad_q, grad_kv, want):
    grad_k, grad_v = grad_kv.chunk(2, dim=-1)
    return [rel(g, w) for g, w in zip((grad_q, grad_k, grad_v), want)]


def float64_check(S, H, D):
    """{variant: [dQ, dK, dV relative errors] or a note} at batch 2."""
    q, k, v, grad_attn, probs, lse, attn_output = make_inputs(2, S, H, D, seed=1)
    scale = 1 / math.sqrt(D)
    want = attention_core.attention_backward_math(
        *(t.double() for t in (probs, grad_attn, q, k, v)), scale)
    result = {}
    for mode, p_or_lse, out in (("P given", probs, None), ("recompute", lse, attn_output)):
        rows, cols, grads = gluon_passes(p_or_lse, halves_of(grad_attn, q, k, v), out,
                                         scale, D, products=3)
        rows()
        cols()
        outputs = grads()
        unwritten = sum(int(t.float().isnan().sum()) for t in outputs)
        result[f"f32 gluon {mode}"] = errors_of(outputs[0], outputs[1], want) + (
            [f"{unwritten} NaN"] if unwritten else [])
        got = attention_core.attention_backward(p_or_lse, grad_attn, q, k, v, scale,
                                                attn_output=out)
        result[f"f32 triton {mode}"] = [rel(g, w) for g, w in zip(got, want)]
    # one product in bf16, P recomputed: against the float64 math on the bf16 values
    # (their log-sum-exp and output from float64 too)
    q16, k16, v16, grad16 = (t.bfloat16() for t in (q, k, v, grad_attn))
    logits16 = (q16.double() @ k16.double().transpose(-1, -2)) * scale
    probs16 = torch.softmax(logits16, -1)
    want16 = attention_core.attention_backward_math(
        probs16, *(t.double() for t in (grad16, q16, k16, v16)), scale)
    rows, cols, grads = gluon_passes(
        torch.logsumexp(logits16, -1).float(),
        [t for t in (grad16, q16, k16, v16) for _ in (0, 1)],
        merge_heads(probs16 @ v16.double()).bfloat16(), scale, D, products=1)
    rows()
    cols()
    outputs = grads()
    unwritten = sum(int(t.float().isnan().sum()) for t in outputs)
    result["bf16 gluon recompute"] = errors_of(outputs[0], outputs[1], want16) + (
        [f"{unwritten} NaN"] if unwritten else [])
    for name, backend in SDPA_BACKENDS.items():
        try:
            _, got = sdpa_backward(backend, q16, k16, v16, grad16, scale)
            result[f"bf16 {name}"] = [rel(g, w) for g, w in zip(got, want16)]
        except RuntimeError as error:
            result[f"bf16 {name}"] = repr(error)[:120]
    return result


def timings(batch, S, H, D):
    """[(variant, ms)] at `batch`."""
    q, k, v, grad_attn, probs, lse, attn_output = make_inputs(batch, S, H, D, seed=0)
    scale = 1 / math.sqrt(D)
    table = []
    operands = halves_of(grad_attn, q, k, v)
    for mode, p_or_lse, out in (("P given", probs, None), ("recompute", lse, attn_output)):
        rows, cols, _ = gluon_passes(p_or_lse, operands, out, scale, D, products=3)
        rows()
        table.append((f"f32 high gluon {mode}", bench(rows) + bench(cols)))
        _, _, delta, _ = attention_core.launch_rows(p_or_lse, grad_attn, q, k, v, out, scale)
        table.append((f"f32 high triton {mode}", bench(
            lambda: attention_core.launch_rows(p_or_lse, grad_attn, q, k, v, out, scale))
            + bench(lambda: attention_core.launch_cols(p_or_lse, grad_attn, q, k, v, delta,
                                                       scale))))
    backward, _ = sdpa_backward(SDPBackend.EFFICIENT_ATTENTION, q, k, v, grad_attn, scale)
    table.append(("f32 sdpa efficient (autograd)", bench(backward)))
    del probs, operands
    q16, k16, v16, grad16 = (t.bfloat16() for t in (q, k, v, grad_attn))
    rows, cols, _ = gluon_passes(lse, [t for t in (grad16, q16, k16, v16) for _ in (0, 1)],
                                 attn_output.bfloat16(), scale, D, products=1)
    rows()
    table.append(("bf16 gluon recompute", bench(rows) + bench(cols)))
    for name, backend in SDPA_BACKENDS.items():
        try:
            backward, _ = sdpa_backward(backend, q16, k16, v16, grad16, scale)
            table.append((f"bf16 {name} (autograd)", bench(backward)))
        except RuntimeError as error:
            table.append((f"bf16 {name}: {repr(error)[:60]}", float("nan")))
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    report = {"batch": args.batch}
    rows = []
    for name, S, H, D in SHAPES:
        try:                          # a failing shape is reported, the others still run
            check = float64_check(S, H, D)
        except Exception as error:
            check = {"failed": repr(error)[:300]}
        entry = {"float64 check, batch 2 (dQ, dK, dV rel. error)": check}
        print(json.dumps({name: entry}), flush=True)
        work = 5 * 2 * args.batch * H * S * S * D
        try:
            measured = timings(args.batch, S, H, D)
        except Exception as error:
            measured = [(f"failed: {repr(error)[:200]}", float("nan"))]
        for variant, ms in measured:
            rows.append((f"{name} ({S}x{H}x{D})", variant, ms, work / (ms * 1e9)))
        entry["timings (variant, ms, TFLOP/s)"] = [r[1:] for r in rows if r[0].startswith(name)]
        report[name] = entry
        Path(args.out, "core_head_dims.json").write_text(json.dumps(report, indent=1))
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


if __name__ == "__main__":
    main()
