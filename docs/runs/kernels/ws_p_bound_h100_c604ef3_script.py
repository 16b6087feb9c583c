"""Probe: what P's loads cost the warp-specialized passes. Variants of
kernels/attention_passes_ws.py made from its source by text substitution:
  real   the kernel as committed
  fixed  P's next tile always loaded from the first tile (cache hits; same instructions)
  none   no P loads at all (a constant tile; no L2 prefetch)
timed at batch 32 (L2 flushed) beside the two-pass Gluon kernels."""
import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, "scripts")
import torch  # noqa: E402
from time_core_gluon import D, H, S, bench, gluon_outputs, halves_of, make_inputs  # noqa

from vitattn_bwd import attention_bwd_ws, gluon_core  # noqa: E402
from vitattn_bwd.kernels import attention_passes_ws  # noqa: E402

SRC = Path(attention_passes_ws.__file__).read_text().replace(
    "from .", "from vitattn_bwd.kernels.")
FIRST_ROWS = "gl.load(probs_head + own_offsets + clamped(tile_walked, SEQ_LEN)[None, :])"
FIRST_COLS = ("gl.load(probs_head + own_offsets\n"
              "                         + (clamped(tile_walked, SEQ_LEN) * SEQ_LEN)[None, :])")
NEXT_ROWS = ("next_p_tile(probs_head, own_offsets, walked, own_start, tile_start,\n"
             "                                 SEQ_LEN, BLOCK_M, BLOCK_N, PREFETCH, num_warps)")
NEXT_COLS = ("next_p_t_tile(probs_head, own_offsets, walked, tile_start, own_start,\n"
             "                                   SEQ_LEN, BLOCK_M, BLOCK_N, PREFETCH, num_warps)")
PREFETCH_LOOP = "    for ahead in gl.static_range(1, PREFETCH + 1):"
CONST = "gl.full([OWN_ROWS, TILE_ROWS], 0.001, gl.float32, layout=tile_layout)"
for text in (FIRST_ROWS, FIRST_COLS, NEXT_ROWS, NEXT_COLS, PREFETCH_LOOP):
    assert text in SRC, text


def variant(name):
    src = SRC
    if name == "fixed":
        src = src.replace(NEXT_ROWS, FIRST_ROWS).replace(NEXT_COLS, FIRST_COLS.replace(
            "\n                         ", " "))
    if name == "none":
        src = (src.replace(NEXT_ROWS, "p_next").replace(NEXT_COLS, "p_next")
               .replace(FIRST_ROWS, CONST).replace(FIRST_COLS, CONST)
               .replace(PREFETCH_LOOP, "    for ahead in gl.static_range(1, 1):"))
    path = Path("tmp_probe") / f"passes_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"passes_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.attention_passes_ws_kernel


batch = 32
flops = 9 * 2 * batch * H * S * S * D
probs, grad_attn, q, k, v, _, scale = make_inputs(batch, recompute=False, seed=batch)
halves = halves_of(grad_attn, q, k, v)
grad_attn_hi, grad_attn_lo, q_hi, q_lo, k_hi, k_lo, v_hi, v_lo = halves
table = []
(rows, cols), outputs = gluon_outputs(probs, halves, None, scale, gluon_core.ROWS_TILES[0],
                                      gluon_core.COLS_TILES[0])
rows()
delta = outputs[2].clone()
table.append(("two-pass rows", bench(rows)))
table.append(("two-pass cols", bench(cols)))
real_kernel = attention_passes_ws.attention_passes_ws_kernel
for name in ("real", "fixed", "none"):
    attention_passes_ws.attention_passes_ws_kernel = (real_kernel if name == "real"
                                                      else variant(name))
    for stages in (3, 4):
        rows_tiles = attention_bwd_ws.PassWsTiles(128, 32, stages)
        cols_tiles = attention_bwd_ws.PassWsTiles(32, 128, stages)

        def run_rows(t=rows_tiles):
            got = gluon_core.rows_outputs(k_hi, 3)
            attention_bwd_ws.launch_rows_ws(probs, grad_attn_hi, grad_attn_lo, k_hi, k_lo,
                                            v_hi, v_lo, got[2], got[1], got[3], got[0],
                                            scale, t)

        def run_cols(t=cols_tiles):
            got = gluon_core.cols_outputs(q_hi, 3)
            attention_bwd_ws.launch_cols_ws(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo,
                                            v_hi, v_lo, delta, got[1], got[2], got[0],
                                            scale, t)
        for label, run in ((f"ws rows {name} {stages} stages", run_rows),
                           (f"ws cols {name} {stages} stages", run_cols)):
            try:
                run()
                torch.cuda.synchronize()
                table.append((label, bench(run)))
            except Exception as error:
                table.append((label, repr(error)[:200]))
            print(table[-1], flush=True)
Path(os.environ.get("OUT", "."), "ws_p_bound.json").write_text(json.dumps(table, indent=1))
print(f"\n| kernel, batch {batch} | ms | TFLOP/s (9 products) |\n|---|---|---|")
for label, ms in table:
    print(f"| {label} | {ms if isinstance(ms, str) else f'{ms:.3f}'} | "
          f"{'' if isinstance(ms, str) else f'{flops / ms / 1e9:.0f}'} |")
