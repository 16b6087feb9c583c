"""The attention core's raw kernels on the GPU: the Gluon kernels (gluon_core.py) against
the Triton kernels (attention_core.py), checked and timed in one call.

    PYTHONPATH=. python3 scripts/time_core_gluon.py [--batch 32] [--out DIR]

For P given (the contract) and P recomputed from its log-sum-exp (the module): every
output of each Gluon variant against the Triton kernel's (relative error of the float32
gradients rebuilt from the bf16 halves, the fp16 copies and delta), every output element
written (outputs poisoned with NaN first), and the median time with the L2 flushed
(triton.testing.do_bench); with P given, the Gluon tiles at several distances of their
L2 prefetch of P (GLUON_VARIANTS). A float64 check at batch 2 runs first. Prints
a table last.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import attention_core, gluon_core  # noqa: E402
from vitattn_bwd.attention_core import TileConfig  # noqa: E402
from vitattn_bwd.precision import split_bf16_rounded  # noqa: E402

S, H, D = 577, 16, 64
E = H * D
TRITON_TILES = {"rows": TileConfig(64, 32, 4, 3), "cols": TileConfig(64, 64, 4, 2)}
# (rows tiles, rows prefetch distance, cols tiles, cols prefetch distance) with P given;
# with P recomputed (no P to prefetch) the configured tiles only
ROWS_64x32, ROWS_64x64 = gluon_core.ROWS_TILES
COLS_32x64, COLS_64x64 = gluon_core.COLS_TILES
GLUON_VARIANTS = [(ROWS_64x32, gluon_core.ROWS_PREFETCH, COLS_32x64, gluon_core.COLS_PREFETCH),
                  (ROWS_64x32, 0, COLS_32x64, 0), (ROWS_64x32, 6, COLS_32x64, 1),
                  (ROWS_64x32, 8, COLS_32x64, 3), (ROWS_64x64, 4, COLS_64x64, 1)]


def make_inputs(batch, recompute, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    q, k, v = randn(batch, H, S, D), randn(batch, H, S, D), randn(batch, H, S, D)
    grad_attn = randn(batch, S, E)
    scale = 1 / math.sqrt(D)
    if recompute:
        logits = (q @ k.transpose(-1, -2)) * scale
        lse = torch.logsumexp(logits, -1)
        out = (torch.softmax(logits, -1) @ v).transpose(1, 2).reshape(batch, S, E)
        del logits
        return lse, grad_attn, q, k, v, out.contiguous(), scale
    probs = torch.softmax(randn(batch, H, S, S), -1)
    return probs, grad_attn, q, k, v, None, scale


def halves_of(grad_attn, q, k, v):
    return [p for t in (grad_attn, q, k, v) for p in split_bf16_rounded(t.contiguous())]


def gluon_outputs(probs, halves, attn_output, scale, rows_tiles, cols_tiles,
                  rows_prefetch=gluon_core.ROWS_PREFETCH,
                  cols_prefetch=gluon_core.COLS_PREFETCH):
    batch = halves[2].shape[0]
    delta = torch.full((batch, H, S), float("nan"), device="cuda")
    grad_q_halves = torch.full((batch, S, 2 * E), float("nan"), device="cuda",
                               dtype=torch.bfloat16)
    grad_q16 = torch.full((batch, S, E), float("nan"), device="cuda", dtype=torch.float16)
    grad_kv_halves = torch.full((batch, S, 4 * E), float("nan"), device="cuda",
                                dtype=torch.bfloat16)
    grad_kv16 = torch.full((batch, S, 2 * E), float("nan"), device="cuda",
                           dtype=torch.float16)
    groups = attention_core.sum_groups(S)
    grad_q_sums = torch.full((batch, groups, E), float("nan"), device="cuda")
    grad_kv_sums = torch.full((batch, groups, 2 * E), float("nan"), device="cuda")
    placeholder = probs if attn_output is None else attn_output

    def rows():
        gluon_core.launch_rows(probs, *halves, placeholder, delta, grad_q_halves,
                               grad_q_sums, grad_q16, scale, rows_tiles, prefetch=rows_prefetch)

    def cols():
        gluon_core.launch_cols(probs, *halves, delta, grad_kv_halves, grad_kv_sums,
                               grad_kv16, scale,
                               cols_tiles, prefetch=cols_prefetch)
    return (rows, cols), (grad_q16, grad_q_halves, delta, grad_q_sums, grad_kv16,
                          grad_kv_halves, grad_kv_sums)


def triton_outputs(probs, grad_attn, q, k, v, attn_output, scale):
    grad_q16, grad_q_halves, delta, grad_q_sums = attention_core.launch_rows(
        probs, grad_attn, q, k, v, attn_output, scale, TRITON_TILES["rows"].block_m,
        TRITON_TILES["rows"].block_n)
    grad_kv16, grad_kv_halves, grad_kv_sums = attention_core.launch_cols(
        probs, grad_attn, q, k, v, delta, scale)
    return grad_q16, grad_q_halves, delta, grad_q_sums, grad_kv16, grad_kv_halves, grad_kv_sums


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def compare(got, ref):
    names = ("grad_q16", "grad_q", "delta", "grad_q_sums", "grad_kv16", "grad_kv",
             "grad_kv_sums")
    errors = {}
    for name, g, r in zip(names, got, ref):
        if name in ("grad_q", "grad_kv"):
            g, r = attention_core.float32_from_halves(g), attention_core.float32_from_halves(r)
        if name.endswith("_sums"):           # where a program puts its sum depends on
            g, r = g.sum(1), r.sum(1)        # its block of rows; their totals do not
        errors[name] = float("nan") if torch.isnan(g.float()).any() else rel(g, r)
    return errors


def float64_check():
    """Gluon at batch 2 against the float64 math, both modes."""
    results = {}
    for recompute in (False, True):
        probs, grad_attn, q, k, v, out, scale = make_inputs(2, recompute, seed=1)
        halves = halves_of(grad_attn, q, k, v)
        (rows, cols), got = gluon_outputs(probs, halves, out, scale,
                                          gluon_core.ROWS_TILES[0], gluon_core.COLS_TILES[0])
        rows()
        cols()
        ref = attention_core.attention_backward_math(
            *(t.double() for t in (probs, grad_attn, q, k, v)), scale,
            attn_output=None if out is None else out.double())
        grad_k, grad_v = attention_core.float32_from_halves(got[5]).chunk(2, dim=-1)
        results["recompute" if recompute else "P given"] = [
            rel(attention_core.float32_from_halves(got[1]), ref[0]), rel(grad_k, ref[1]),
            rel(grad_v, ref[2])]
    return results


def bench(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    report = {"float64 check (dQ, dK, dV rel. error), batch 2": float64_check()}
    print(json.dumps(report), flush=True)
    rows_table = []
    for recompute in (False, True):
        mode = "recompute" if recompute else "P given"
        probs, grad_attn, q, k, v, out, scale = make_inputs(args.batch, recompute)
        halves = halves_of(grad_attn, q, k, v)
        ref = triton_outputs(probs, grad_attn, q, k, v, out, scale)
        triton_ms = {
            "rows": bench(lambda: attention_core.launch_rows(
                probs, grad_attn, q, k, v, out, scale, TRITON_TILES["rows"].block_m,
                TRITON_TILES["rows"].block_n)),
            "cols": bench(lambda: attention_core.launch_cols(
                probs, grad_attn, q, k, v, ref[2], scale))}
        rows_table.append((mode, "triton", "rows", tuple(TRITON_TILES["rows"]), "-",
                           triton_ms["rows"], {}))
        rows_table.append((mode, "triton", "cols", tuple(TRITON_TILES["cols"]), "-",
                           triton_ms["cols"], {}))
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
                rows_ms, cols_ms = bench(rows), bench(cols)
            except Exception as error:          # report and go on to the next variant
                errors, rows_ms, cols_ms = {"error": repr(error)[:300]}, float("nan"), float("nan")
            rows_table.append((mode, "gluon", "rows", tuple(rows_tiles), rows_prefetch, rows_ms,
                               {k: v for k, v in errors.items()
                                if k in ("grad_q16", "grad_q", "delta", "grad_q_sums",
                                         "error")}))
            rows_table.append((mode, "gluon", "cols", tuple(cols_tiles), cols_prefetch, cols_ms,
                               {k: v for k, v in errors.items()
                                if k in ("grad_kv16", "grad_kv", "grad_kv_sums", "error")}))
    Path(args.out, "core_gluon.json").write_text(json.dumps(rows_table, indent=1))
    print(f"batch {args.batch}")
    print(f"{'mode':10} {'kernel':7} {'pass':5} {'tiles':18} {'pref':>4} {'ms':>7}  errors vs triton")
    for mode, kind, name, tiles, prefetch, ms, errors in rows_table:
        err = " ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in errors.items())
        print(f"{mode:10} {kind:7} {name:5} {tiles!s:18} {prefetch!s:>4} {ms:7.3f}  {err}")


if __name__ == "__main__":
    main()
