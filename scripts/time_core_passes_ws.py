"""The warp-specialized passes with P given (attention_bwd_ws.launch_rows_ws: dQ and
delta; launch_cols_ws: dK and dV; three products) against the two-pass Gluon kernels,
checked and timed in one call on the GPU; or, with --sm90, their machine code on any
machine.

    PYTHONPATH=. python3 scripts/time_core_passes_ws.py [--batch 32] [--out DIR]
    PYTHONPATH=. python3 scripts/time_core_passes_ws.py --sm90    # CPU: one JSON line

On the GPU, the contract's inputs (float32, 577 tokens, 16 heads of 64, P a softmax of
its own) and their bf16 halves, rounded (time_core_gluon's). At batch 1 and --batch:
the two-pass Gluon rows and cols kernels at each of their tiles, then each
configuration of ROWS_WS_TILES (into its own delta) and of COLS_WS_TILES (with the
two-pass rows pass's delta): the relative errors of dQ, dK, dV (rebuilt from the bf16
halves) and of the column sums (relative to the gradient's norm) against float64,
whether the gradients and delta are bitwise those of the two-pass kernel with the
same tiles of the walked side (64 x 32 rows, 32 x 64 cols: the same products in the
same order; the column sums are grouped by each kernel's row block, so only their
totals compare), bitwise repeatable over 3 calls, and every element written (outputs poisoned with NaN first). Each
configuration's first calls run under a 120 s deadline that ends the process (exit
status 3, "HANG") if they never finish. At --batch: the median time with the L2
flushed of each, with TFLOP/s of a pass's 9 bf16 products of 2*B*H*S^2*D. Prints a
table last; details in DIR/core_passes_ws.json.

--sm90 compiles each configuration for sm_90 (no launch) and prints, per pass,
configuration and q layout (contiguous, head views): shared memory, threads, spill
bytes (in the walk too), HGMMA and wgmma-wait counts, the setmaxnreg register counts,
and any ptxas note that it serialized the wgmmas (time_core_ws.ws_resources).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from time_core_ws import command_line, deadline, ws_resources  # noqa: E402

from vitattn_bwd import attention_bwd_ws  # noqa: E402

PASSES = (("rows", True, attention_bwd_ws.ROWS_WS_TILES),
          ("cols", False, attention_bwd_ws.COLS_WS_TILES))


def sm90_report():
    """[(pass, tiles, heads_in_rows, ws_resources)] of each configuration compiled for
    sm_90, for both q layouts."""
    return [(name, list(tiles), heads_in_rows, ws_resources(
        attention_bwd_ws.compile_pass_ws_sm90(tiles, rows_pass, heads_in_rows=heads_in_rows)))
        for name, rows_pass, configurations in PASSES for tiles in configurations
        for heads_in_rows in (True, False)]


def poisoned(outputs):
    """outputs filled with NaN, so that an element a kernel does not write shows."""
    return [t.fill_(float("nan")) for t in outputs]


def sums_error(sums, want):
    """The error of the column sums of a gradient against the float64 gradient `want`'s,
    relative to want's norm: dK's columns sum to about zero (each row of dS does), so
    relative to their own total the error would be the cancellation's."""
    return ((sums.double() - want.double().sum(1)).norm() / want.double().norm()).item()


def gpu_main(batch, out_dir):
    import torch
    from time_core_gluon import D, H, S, bench, gluon_outputs, halves_of, make_inputs, rel

    from vitattn_bwd import attention_core, gluon_core
    flops = 9 * 2 * batch * H * S * S * D
    report, table = {}, []
    for b in dict.fromkeys((1, batch)):
        probs, grad_attn, q, k, v, _, scale = make_inputs(b, recompute=False, seed=b)
        halves = halves_of(grad_attn, q, k, v)
        grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo = halves
        want = attention_core.attention_backward_math(
            *(t.double() for t in (probs, grad_attn, q, k, v)), scale)
        checks, two_pass = {}, {}
        for rows_tiles, cols_tiles in zip(gluon_core.ROWS_TILES, gluon_core.COLS_TILES):
            (rows, cols), outputs = gluon_outputs(probs, halves, None, scale, rows_tiles,
                                                  cols_tiles)
            rows()
            cols()
            two_pass["rows", tuple(rows_tiles)] = outputs[:4]
            two_pass["cols", tuple(cols_tiles)] = outputs[4:]
            grad_q = attention_core.float32_from_halves(outputs[1])
            grad_k, grad_v = attention_core.float32_from_halves(outputs[5]).chunk(2, dim=-1)
            checks[f"two-pass gluon {tuple(rows_tiles)} {tuple(cols_tiles)}"] = dict(
                dQ=rel(grad_q, want[0]), dK=rel(grad_k, want[1]), dV=rel(grad_v, want[2]))
            if b == batch:
                for name, run, tiles in (("rows", rows, rows_tiles), ("cols", cols, cols_tiles)):
                    ms = bench(run)
                    table.append((f"two-pass gluon {name} {tuple(tiles)}", ms, flops / ms / 1e9))
        delta = two_pass["rows", tuple(gluon_core.ROWS_TILES[0])][2]
        for name, rows_pass, configurations in PASSES:
            reference = two_pass[("rows", (64, 32, 4, 2)) if rows_pass
                                 else ("cols", (32, 64, 4, 3))]
            for tiles in configurations:
                label = f"ws {name} {tiles.label}"

                def run(tiles=tiles, rows_pass=rows_pass):
                    if rows_pass:
                        got = poisoned(gluon_core.rows_outputs(k_hi, 3))
                        attention_bwd_ws.launch_rows_ws(
                            probs, grad_attn_hi, grad_attn_lo, k_hi, k_lo, v_hi, v_lo,
                            got[2], got[1], got[3], got[0], scale, tiles)
                    else:
                        got = poisoned(gluon_core.cols_outputs(q_hi, 3))
                        attention_bwd_ws.launch_cols_ws(
                            probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, v_hi, v_lo,
                            delta, got[1], got[2], got[0], scale, tiles)
                    return got
                try:
                    with deadline(120, f"{label} at batch {b} (compile and 4 calls)"):
                        got = run()
                        again = [run() for _ in range(3)]
                        torch.cuda.synchronize()
                    if rows_pass:       # grad_q16, grad_q_halves, delta, grad_q_sums
                        errors = dict(dQ=rel(attention_core.float32_from_halves(got[1]),
                                             want[0]),
                                      sums_dQ=sums_error(got[3].double().sum(1), want[0]))
                        compared = got[:3]
                    else:               # grad_kv16, grad_kv_halves, grad_kv_sums
                        grad_k, grad_v = attention_core.float32_from_halves(got[1]).chunk(
                            2, dim=-1)
                        sums_k, sums_v = got[2].double().sum(1).chunk(2, dim=-1)
                        errors = dict(dK=rel(grad_k, want[1]), dV=rel(grad_v, want[2]),
                                      sums_dK=sums_error(sums_k, want[1]),
                                      sums_dV=sums_error(sums_v, want[2]))
                        compared = got[:2]
                    checks[label] = dict(
                        errors,
                        every_element_written=not any(t.float().isnan().any() for t in got),
                        bitwise_two_pass=all(torch.equal(a, r)
                                             for a, r in zip(compared, reference)),
                        bitwise_repeatable=all(torch.equal(a, g) for o in again
                                               for a, g in zip(o, got)))
                    if b == batch:
                        ms = bench(run)
                        table.append((label, ms, flops / ms / 1e9))
                except Exception as error:  # report and go on to the next configuration
                    checks[label] = repr(error)[:300]
        report[f"batch {b}"] = checks
        print(json.dumps({f"batch {b}": checks}), flush=True)
    report["table"] = table
    Path(out_dir, "core_passes_ws.json").write_text(json.dumps(report, indent=1))
    print(f"\n| kernel, batch {batch} | ms | TFLOP/s (9 products) |\n|---|---|---|")
    for name, ms, tflops in table:
        print(f"| {name} | {ms:.3f} | {tflops:.0f} |")


def main():
    command_line(__doc__, sm90_report, gpu_main)


if __name__ == "__main__":
    main()
