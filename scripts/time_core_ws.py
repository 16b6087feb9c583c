"""The warp-specialized one-pass attention-core backward (attention_bwd_ws.py) against
the current Gluon rows + cols kernels and SDPA's cuDNN and flash backwards, checked and
timed in one call on the GPU; or, with --sm90, its machine code on any machine.

    PYTHONPATH=. python3 scripts/time_core_ws.py [--batch 32] [--out DIR]
    PYTHONPATH=. python3 scripts/time_core_ws.py --sm90      # CPU: one JSON line

On the GPU, bf16, head dim 64, 577 tokens, 16 heads, q, k, v the head views of one QKV
projection [B,S,3E] and the forward from torch's flash attention (time_core_half's
inputs). At batch 1 and --batch, for each configuration in attention_bwd_ws.TILES and
CANDIDATE_TILES: relative errors of dQ, dK, dV against float64 (P recomputed from the
same lse) beside those of the current Gluon kernels and of SDPA's flash and cuDNN
backwards; the relative difference from the current Gluon kernels; bitwise equality
over 3 calls and between the QKV views and contiguous copies. Each configuration's
first calls run under a 120 s deadline that ends the process (exit status 3, "HANG"
printed) if they never finish. At --batch: the median time (L2 flushed) of each
configuration's whole backward (delta kernel, which zeroes the semaphores, then the
main kernel); of each delta kernel configuration (DELTA_TILES, DELTA_CANDIDATE_TILES)
alone and before the fastest main kernel, with whether its outputs are bitwise
DELTA_TILES'; of the current rows + cols, and of SDPA's raw
flash and cuDNN backward operators (from their own forwards; cuDNN's adds dQ with
atomics), with TFLOP/s of 5 products of 2*B*H*S^2*D each; and the forwards the
deterministic attention could run (torch's flash and cuDNN's, with their log-sum-exp:
times, their difference, whether cuDNN's runs under the deterministic flag). Prints a
table last; details in DIR/core_ws.json.

--sm90 compiles each configuration (both lists) for sm_90 (no launch) and prints, per
configuration: shared memory, threads, spill bytes, HGMMA and wgmma-wait counts in the
SASS, the setmaxnreg register counts, and any ptxas note that it serialized the wgmmas.
"""
import argparse
import contextlib
import json
import os
import re
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vitattn_bwd import attention_bwd_ws  # noqa: E402


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


def sm90_report():
    """[(tiles, ws_resources)] of each configuration compiled for sm_90."""
    return [(list(tiles), ws_resources(attention_bwd_ws.compile_sm90(tiles)))
            for tiles in attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES]


@contextlib.contextmanager
def deadline(seconds, what):
    """End the process (exit status 3) if the block, which must synchronize the GPU,
    takes longer than `seconds`: a kernel waiting on a semaphore that never comes
    would otherwise hang the device call until its limit."""
    def expire():
        print(f"HANG: {what} did not finish in {seconds} s", flush=True)
        os._exit(3)
    timer = threading.Timer(seconds, expire)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def gpu_main(batch, out_dir):
    import torch

    from time_core_gluon import D, H, S, bench, rel
    from time_core_half import SCALE, make_inputs, ours, torch_backward
    from torch.nn.attention import SDPBackend

    from vitattn_bwd import attention_core, gluon_core
    from vitattn_bwd.layout import merge_heads
    flops = 5 * 2 * batch * H * S * S * D
    report, table = {}, []

    def sdpa_raw(q, k, v, grad_attn):
        """{name: (backward closure, (dQ, dK, dV) merged [B,S,E])} of SDPA's raw flash
        and cuDNN backward operators, each from its own forward; an error string where
        an operator does not run."""
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

    def forwards(q, k, v):
        """The deterministic attention's forward choices (deterministic_sdpa.py): torch's
        flash forward, and cuDNN's with its log-sum-exp, timed; how far cuDNN's output
        and lse are from flash's; whether cuDNN's runs under the deterministic flag."""
        flash = lambda: torch.ops.aten._scaled_dot_product_flash_attention(  # noqa: E731
            q, k, v, scale=SCALE)[:2]
        cudnn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
            q, k, v, None, True, scale=SCALE)[:2]
        checks, outputs = {}, {}
        for name, forward in (("sdpa flash fwd (raw)", flash),
                              ("sdpa cudnn fwd (raw)", cudnn)):
            try:
                outputs[name] = forward()
                ms = bench(forward)                         # two products of five
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

    def delta_kernels(grad_attn, attn_output, lse, q, k, v):
        """Each delta kernel configuration (DELTA_TILES, DELTA_CANDIDATE_TILES) timed
        alone and with the main kernel at FASTEST_TILES; whether its outputs (delta, the
        base-2 lse, the zeroed semaphores) are bitwise DELTA_TILES'."""
        fastest = attention_bwd_ws.FASTEST_TILES
        expected = attention_bwd_ws.launch_delta(grad_attn, attn_output, lse, H,
                                                 fastest.block_m)
        checks = {}
        for delta_tiles in (attention_bwd_ws.DELTA_TILES,
                            *attention_bwd_ws.DELTA_CANDIDATE_TILES):
            try:
                got = attention_bwd_ws.launch_delta(grad_attn, attn_output, lse, H,
                                                    fastest.block_m, delta_tiles)
                checks[str(tuple(delta_tiles))] = dict(
                    bitwise_delta_tiles=all(torch.equal(a, g) for a, g in zip(expected, got)),
                    semaphores_zero=bool((got[2] == 0).all()))
                ms = bench(lambda: attention_bwd_ws.launch_delta(  # noqa: B023
                    grad_attn, attn_output, lse, H, fastest.block_m, delta_tiles))
                table.append(("ws delta kernel alone", tuple(delta_tiles), ms, float("nan")))
                ms = bench(lambda: attention_bwd_ws.launch(  # noqa: B023
                    q, k, v, grad_attn, attn_output, lse, SCALE, fastest,
                    delta_tiles=delta_tiles))
                table.append(("ws, this delta kernel", tuple(delta_tiles), ms,
                              flops / ms / 1e9))
            except Exception as error:      # report and go on to the next configuration
                checks[str(tuple(delta_tiles))] = repr(error)[:300]
        print(json.dumps({"delta kernels": checks}), flush=True)
        return checks

    for b in dict.fromkeys((1, batch)):
        q, k, v, grad_attn, attn_output, lse = make_inputs(b, torch.bfloat16, seed=b)
        if b == batch:
            report[f"batch {b}: forwards"] = forwards(q, k, v)
            print(json.dumps(report[f"batch {b}: forwards"]), flush=True)
        ref = attention_core.attention_backward_math(
            *(t.double() for t in (attention_core.probabilities(
                lse.double(), q.double(), k.double(), SCALE), grad_attn, q, k, v)), SCALE)
        checks, outputs = {}, {}
        contiguous = [t.contiguous() for t in (q, k, v)]
        for tiles in attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES:
            name = f"ws {tuple(tiles)}"

            def run(q=q, k=k, v=v, tiles=tiles):
                return attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse,
                                               SCALE, tiles).chunk(3, dim=-1)
            try:
                with deadline(120, f"{name} at batch {b} (compile and 5 calls)"):
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
                    ms = bench(run)
                    table.append(("ws one pass", tuple(tiles), ms, flops / ms / 1e9))
            except Exception as error:      # report and go on to the next configuration
                checks[name] = repr(error)[:300]
                print(json.dumps({f"batch {b}, {name}": checks[name]}), flush=True)
        if b == batch:
            checks["delta kernels"] = delta_kernels(grad_attn, attn_output, lse, q, k, v)
        try:                                 # gluon_core's kernels, as they are today
            (rows, cols), current = ours(q, k, v, grad_attn, attn_output, lse,
                                         gluon_core.ROWS_TILES[0], gluon_core.COLS_TILES[0])
            rows()
            cols()
            current = (current[0], *current[1].chunk(2, dim=-1))
            checks["current gluon rows+cols"] = [rel(g, r) for g, r in zip(current, ref)]
            for name, got in outputs.items():
                checks[name]["vs_current"] = [rel(g, c) for g, c in zip(got, current)]
            if b == batch:
                ms = bench(lambda: (rows(), cols()))
                table.append(("current gluon rows+cols", "-", ms, flops / ms / 1e9))
        except Exception as error:
            checks["current gluon rows+cols"] = repr(error)[:300]
        for name, entry in sdpa_raw(q, k, v, grad_attn).items():
            checks[name] = entry if isinstance(entry, str) else [
                rel(g, r) for g, r in zip(entry[1], ref)]
            if b == batch and not isinstance(entry, str):
                ms = bench(entry[0])
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
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, "core_ws.json").write_text(json.dumps(report, indent=1))


def command_line(description, sm90_report, gpu_main):
    """A timing script's command line: --sm90 prints sm90_report() as one JSON line,
    else gpu_main(batch, out_dir) checks and times on the GPU."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sm90", action="store_true",
                        help="compile for sm_90 and print its resources (no GPU needed)")
    args = parser.parse_args()
    if args.sm90:
        print(json.dumps(sm90_report()))
    else:
        gpu_main(args.batch, args.out)


def main():
    command_line(__doc__, sm90_report, gpu_main)


if __name__ == "__main__":
    main()
