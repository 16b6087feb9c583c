"""The benchmark's workloads, its input distribution and its tolerance rule, carried by
the package so that scripts and tests run where only this repository travels."""
import math

import torch

BATCH_SIZES = (1, 2, 3, 5, 7, 10, 12, 14, 23, 28, 32, 37, 41, 47, 53, 56)
SEQ_LEN, EMBED_DIM, NUM_HEADS, NORM_EPS = 577, 1024, 16, 1e-5
OUTPUT_NAMES = ("grad_x", "grad_qkv_weight", "grad_qkv_bias", "grad_out_weight",
                "grad_out_bias", "grad_ln_weight", "grad_ln_bias")


def make_inputs(batch, seq_len=SEQ_LEN, embed_dim=EMBED_DIM, num_heads=NUM_HEADS,
                device="cpu", dtype=torch.float32, generator=None):
    """The 15 inputs, drawn as the benchmark draws them: randn everywhere except
    x_var = |randn| + 0.1, attn_weights = softmax(randn) over the last axis (so P is NOT
    softmax(q k^T)), qkv_weight and out_weight = randn / sqrt(fan_in)."""
    B, S, E, H = batch, seq_len, embed_dim, num_heads

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    return dict(
        grad_output=randn(B, S, E), x=randn(B, S, E), x_mean=randn(B, S, 1),
        x_var=randn(B, S, 1).abs() + 0.1, x_norm=randn(B, S, E), ln_weight=randn(E),
        qkv_weight=randn(3 * E, E) / math.sqrt(E),
        q=randn(B, H, S, E // H), k=randn(B, H, S, E // H), v=randn(B, H, S, E // H),
        attn_weights=torch.softmax(randn(B, H, S, S), dim=-1), attn_output=randn(B, S, E),
        out_weight=randn(E, E) / math.sqrt(E),
        scale=1.0 / math.sqrt(E // H), norm_eps=NORM_EPS)


def within_tolerance(out, ref, atol=1e-2, rtol=1e-2, required=0.99):
    """The benchmark's rule for one output: finite, not all zero where ref is not, and at
    least 99% of elements with |out - ref| <= atol + rtol * |ref|.
    Returns (ok, matched_fraction)."""
    out, ref = out.float(), ref.float()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return False, 0.0
    if ref.norm() > 0 and out.norm() == 0:
        return False, 0.0
    matched = 1.0 - (out - ref).abs().gt(atol + rtol * ref.abs()).float().mean().item()
    return matched >= required, matched
