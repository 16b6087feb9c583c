"""The warp-specialized cols pass (attention_bwd_ws.launch_cols_ws: dK, dV with P given,
three products) against the two-pass Gluon and Triton cols kernels, checked and timed
in one call on the GPU; or, with --sm90, its machine code on any machine.

    PYTHONPATH=. python3 scripts/time_core_cols_ws.py [--batch 32] [--out DIR]
    PYTHONPATH=. python3 scripts/time_core_cols_ws.py --sm90      # CPU: one JSON line

On the GPU, the contract's inputs (float32, 577 tokens, 16 heads of 64, P a softmax of
its own), their bf16 halves rounded (time_core_gluon's), and delta from the Gluon rows
pass. At batch 1 and --batch, for each configuration in COLS_WS_TILES: the relative
error of dK and dV (rebuilt from the bf16 halves) and of the column sums against
float64, the same of the two-pass Gluon cols kernel at each of its tiles, whether the
gradients are bitwise those of the two-pass kernel at 32 x 64 tiles (the same
products in the same order; the column sums are grouped by each kernel's key block, so
only their totals compare) and bitwise repeatable over 3 calls, and every element written
(outputs poisoned with NaN first). Each configuration's first calls run under a 120 s
deadline that ends the process (exit status 3, "HANG") if they never finish. At
--batch: the median time with the L2 flushed of each, with TFLOP/s of the cols pass's 9
bf16 products of 2*B*H*S^2*D. Prints a table last; details in DIR/core_cols_ws.json.

--sm90 compiles each configuration for sm_90 (no launch) and prints, per configuration
and q layout (contiguous, head views): shared memory, threads, spill bytes (in the walk
over query tiles too), HGMMA and wgmma-wait counts, the setmaxnreg register counts, and
any ptxas note that it serialized the wgmmas.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from time_core_ws import command_line, ws_resources  # noqa: E402

from vitattn_bwd import attention_bwd_ws  # noqa: E402


def sm90_report():
    """[(tiles, heads_in_rows, time_core_ws.ws_resources)] of each configuration compiled
    for sm_90, for both q layouts."""
    return [(list(tiles), heads_in_rows, ws_resources(
        attention_bwd_ws.compile_cols_ws_sm90(tiles, heads_in_rows=heads_in_rows)))
        for tiles in attention_bwd_ws.COLS_WS_TILES for heads_in_rows in (True, False)]


def gpu_main(batch, out_dir):
    import torch
    from time_core_gluon import D, H, S, bench, gluon_outputs, halves_of, make_inputs, rel
    from time_core_ws import deadline

    from vitattn_bwd import attention_core, gluon_core
    flops = 9 * 2 * batch * H * S * S * D
    report, table = {}, []
    for b in dict.fromkeys((1, batch)):
        probs, grad_attn, q, k, v, _, scale = make_inputs(b, recompute=False, seed=b)
        halves = halves_of(grad_attn, q, k, v)
        grad_attn_hi, grad_attn_lo, q_hi, q_lo, _, _, v_hi, v_lo = halves
        want = attention_core.attention_backward_math(
            *(t.double() for t in (probs, grad_attn, q, k, v)), scale)
        checks, two_pass = {}, {}
        for cols_tiles in gluon_core.COLS_TILES:
            (rows, cols), outputs = gluon_outputs(probs, halves, None, scale,
                                                  gluon_core.ROWS_TILES[0], cols_tiles)
            rows()
            cols()
            grad_k, grad_v = attention_core.float32_from_halves(outputs[5]).chunk(2, dim=-1)
            name = f"two-pass gluon cols {tuple(cols_tiles)}"
            two_pass[tuple(cols_tiles)] = outputs
            checks[name] = dict(dK=rel(grad_k, want[1]), dV=rel(grad_v, want[2]))
            if b == batch:
                ms = bench(cols)
                table.append((name, ms, flops / ms / 1e9))
        delta = two_pass[tuple(gluon_core.COLS_TILES[0])][2]
        reference = two_pass[(32, 64, 4, 3)][4:]
        for tiles in attention_bwd_ws.COLS_WS_TILES:
            name = f"ws cols {tuple(tiles)}"

            def run(tiles=tiles):
                outputs = poisoned_cols_outputs(q_hi)
                attention_bwd_ws.launch_cols_ws(
                    probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, v_hi, v_lo, delta,
                    outputs[1], outputs[2], outputs[0], scale, tiles)
                return outputs
            try:
                with deadline(120, f"{name} at batch {b} (compile and 4 calls)"):
                    got = run()
                    again = [run() for _ in range(3)]
                    torch.cuda.synchronize()
                grad_k, grad_v = attention_core.float32_from_halves(got[1]).chunk(2, dim=-1)
                sums_k, sums_v = got[2].double().sum(1).chunk(2, dim=-1)
                checks[name] = dict(
                    dK=rel(grad_k, want[1]), dV=rel(grad_v, want[2]),
                    sums_dK=rel(sums_k, want[1].sum(1)), sums_dV=rel(sums_v, want[2].sum(1)),
                    every_element_written=not any(t.float().isnan().any() for t in got),
                    bitwise_two_pass_32x64=all(torch.equal(a, r)
                                               for a, r in zip(got[:2], reference[:2])),
                    bitwise_repeatable=all(torch.equal(a, g) for o in again
                                           for a, g in zip(o, got)))
                if b == batch:
                    ms = bench(run)
                    table.append((name, ms, flops / ms / 1e9))
            except Exception as error:      # report and go on to the next configuration
                checks[name] = repr(error)[:300]
        report[f"batch {b}"] = checks
        print(json.dumps({f"batch {b}": checks}), flush=True)
    report["table"] = table
    Path(out_dir, "core_cols_ws.json").write_text(json.dumps(report, indent=1))
    print(f"\n| kernel, batch {batch} | ms | TFLOP/s (9 products) |\n|---|---|---|")
    for name, ms, tflops in table:
        print(f"| {name} | {ms:.3f} | {tflops:.0f} |")


def poisoned_cols_outputs(q_hi):
    """The cols pass's outputs (grad_kv16, grad_kv_halves, grad_kv_sums) filled with NaN,
    so that an element the kernel does not write shows."""
    from vitattn_bwd.gluon_core import cols_outputs
    return [t.fill_(float("nan")) for t in cols_outputs(q_hi, 3)]


def main():
    command_line(__doc__, sm90_report, gpu_main)


if __name__ == "__main__":
    main()
