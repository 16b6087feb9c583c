"""Registers, spills, shared memory and tensor-core instructions of our Triton kernels as
compiled for an H100/H200 (sm_90), without a GPU: Triton's front end and the ptxas and
cuobjdump bundled with its CUDA backend do the work on the CPU.

    PYTHONPATH=. python3 scripts/kernel_resources.py              # the configured tiles
    PYTHONPATH=. python3 scripts/kernel_resources.py --sweep      # candidate tiles too
    PYTHONPATH=. python3 scripts/kernel_resources.py --sass DIR   # and each one's SASS
    PYTHONPATH=. python3 scripts/kernel_resources.py --head-dim 72  # the attention kernels
                                                                  # at another head dim

The SASS files (instruction addresses left out) show whether a refactor of a kernel's
source changed its machine code: `diff -r` two such folders.

A kernel that spills (spill stores > 0) keeps part of its tiles in local memory and
runs far below the tensor cores' rate; HGMMA counts Hopper's warpgroup matrix
instructions, HMMA the older per-warp ones (tiles under 64 rows), waits the warpgroup
MMA waits (WARPGROUP.DEPBAR): the Gluon kernels issue their products asynchronously and
wait three times per tile where Triton's tl.dot waits after each product; L2 prefetches
count the Gluon kernels' requests for P tiles ahead of their loads (CCTL.E.PF2), fp64 ops
the float64 arithmetic (DADD, DMUL, DFMA). Each kernel is compiled as a real launch
specializes it: pointers and integer arguments divisible by 16, and the LayerNorm
kernel's norm_eps a float64 scalar, as Inductor launches the LayerNorm operator.
"""
import argparse
import itertools
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from vitattn_bwd.softmax_bwd import COLUMN_SUM_ROWS, TileConfig, head_tile
from vitattn_bwd.split_gemm import GROUP_M, GemmTiles

SEQ_LEN, NUM_HEADS, HEAD_DIM = 577, 16, 64        # ViT-L/14-336's; --head-dim for others


class Resources(NamedTuple):
    registers: int
    spill_stores: int
    shared_bytes: int
    hgmma: int          # warpgroup MMA instructions in the SASS
    hmma: int           # per-warp MMA instructions in the SASS
    waits: int          # warpgroup MMA waits (WARPGROUP.DEPBAR) in the SASS
    l2_prefetches: int  # L2 prefetches (CCTL.E.PF2, from prefetch.global.L2) in the SASS
    fp64_ops: int       # float64 adds, multiplies and FMAs (DADD, DMUL, DFMA) in the SASS


def _is_gluon(kernel):
    return type(kernel).__name__ == "GluonJITFunction"


def _signature(kernel, constexprs, operand_dtype=None):
    """Triton signature of `kernel`: bf16 pointers for the *_HI/*_LO/*_HALVES operands,
    fp16 for *16 outputs, fp32 for other pointers (upper case), fp32 `scale`, i32
    strides; the given constexprs. With operand_dtype ("bf16" or "fp16": the one-product
    kernels of half-precision inputs) the *_HI/*_LO operands, the *16 outputs and the
    forward's output ATTN_OUT have that type; with "fp16 halves" (precision "highest")
    the *_HI/*_LO operands are fp16 and the *16 outputs float32."""
    signature = {}
    if operand_dtype == "fp16 halves":
        for name in kernel.arg_names:
            if name.endswith(("_HI", "_LO")):
                signature[name] = "*fp16"
            elif name.endswith("16"):
                signature[name] = "*fp32"
    elif operand_dtype is not None:
        for name in kernel.arg_names:
            if name.endswith(("_HI", "_LO", "16")) or name == "ATTN_OUT":
                signature[name] = f"*{operand_dtype}"
    for name in kernel.arg_names:
        if name in signature:
            continue
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "scale":
            signature[name] = "fp32"
        elif name == "norm_eps":            # as Inductor launches the LayerNorm operator
            signature[name] = "fp64"
        elif not name.isupper() or name in ("M", "N", "K"):
            signature[name] = "i32"
        elif name.endswith(("_HI", "_LO", "_HALVES")):
            signature[name] = "*bf16"
        elif name.endswith("16"):
            signature[name] = "*fp16"
        else:
            signature[name] = "*fp32"
    return signature


def _tile_constexprs(tiles):
    """The constexprs a launch configuration sets: an attention kernel's TileConfig or
    the split GEMM's GemmTiles (their block sizes, as the templates get them), or the
    LayerNorm kernel's LayerNormTiles."""
    if isinstance(tiles, (TileConfig, GemmTiles)):
        from vitattn_bwd.inductor import block_constexprs
        return block_constexprs(tiles)
    return dict(ROWS_PER_CHUNK=tiles.rows_per_chunk, CHUNKS=tiles.chunks)


def _cuda_tools():
    """(ptxas, cuobjdump): the paths of the tools triton itself runs for sm_90. Which
    ptxas that is differs by release (3.9 compiles sm_90 with its bundled
    ptxas-blackwell, and its PTX is newer than its plain ptxas reads)."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(90).path, knobs.nvidia.cuobjdump.path


def ptxas_report_and_sass(compiled):
    """(ptxas -v's report on the PTX of `compiled`, a kernel triton compiled for sm_90:
    registers, spills, its serialization notes; the SASS of its cubin)."""
    ptxas, cuobjdump = _cuda_tools()
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        ptx.write_text(compiled.asm["ptx"])
        cubin.write_bytes(compiled.asm["cubin"])
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(ptx),
                                 "-o", str(Path(tmp) / "ptxas.cubin")],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    return report, sass


def sm90_resources(kernel, constexprs, tiles, sass_file=None):
    """Compile `kernel` (Triton or Gluon) with `constexprs` and `tiles` (a TileConfig or
    LayerNormTiles) for sm_90a; its SASS, without instruction addresses, to `sass_file`
    if given. An OPERAND_DTYPE entry of constexprs is _signature's operand_dtype, not a
    constexpr."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs, **_tile_constexprs(tiles))
    operand_dtype = constexprs.pop("OPERAND_DTYPE", None)
    num_stages = getattr(tiles, "num_stages", 3)               # 3: Triton's default
    source = ASTSource
    if _is_gluon(kernel):
        from triton.experimental.gluon._runtime import GluonASTSource
        constexprs.update(NUM_STAGES=num_stages, num_warps=tiles.num_warps)
        source = GluonASTSource
    signature = _signature(kernel, constexprs, operand_dtype)
    names = kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind not in ("fp32", "constexpr")}
    compiled = triton.compile(
        source(kernel, signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=tiles.num_warps, num_stages=num_stages))
    report, sass = ptxas_report_and_sass(compiled)
    if sass_file is not None:
        Path(sass_file).write_text("\n".join(re.sub(r"/\*[0-9a-f]{4}\*/", "", line)
                                             for line in sass.splitlines() if "/*" in line))
    return Resources(registers=int(re.search(r"Used (\d+) registers", report)[1]),
                     spill_stores=int(re.search(r"(\d+) bytes spill stores", report)[1]),
                     shared_bytes=compiled.metadata.shared,
                     hgmma=len(re.findall(r"\bHGMMA\b", sass)),
                     hmma=len(re.findall(r"\bHMMA\b", sass)),
                     waits=len(re.findall(r"WARPGROUP\.DEPBAR", sass)),
                     l2_prefetches=len(re.findall(r"CCTL\.E\.PF2", sass)),
                     fp64_ops=len(re.findall(r"\bD(?:ADD|MUL|FMA)\b", sass)))


def kernels(head_dim=HEAD_DIM):
    """(name, kernel, constexprs without the block sizes, configured tiles) of each
    kernel variant we launch; at a head_dim other than HEAD_DIM the attention kernels
    only (the LayerNorm kernel and the split GEMM do not depend on it)."""
    from vitattn_bwd import attention_fwd, inductor, layer_norm_bwd
    from vitattn_bwd.kernels.attention_fwd import attention_fwd_kernel
    from vitattn_bwd.kernels.layer_norm_bwd import layer_norm_bwd_kernel
    from vitattn_bwd.kernels.softmax_bwd import (softmax_bwd_cols_kernel,
                                                 softmax_bwd_rows_kernel)
    from vitattn_bwd.kernels.split_gemm import split_gemm_kernel
    shape = dict(SEQ_LEN=SEQ_LEN, NUM_HEADS=NUM_HEADS, HEAD_DIM=head_dim)
    variants = [("forward", attention_fwd_kernel, shape,
                 (attention_fwd.FWD_TILES[head_tile(head_dim)],))]
    if head_dim == HEAD_DIM:
        variants.append(("layer norm", layer_norm_bwd_kernel,
                         dict(EMBED=NUM_HEADS * HEAD_DIM, BLOCK_E=NUM_HEADS * HEAD_DIM,
                              EXACT=True, PARTS=4), (layer_norm_bwd.TILES,)))
    gluon = _gluon_kernels(head_dim)
    for recompute in (False, True):
        mode = " recompute P" if recompute else ""
        for name, kernel, tiles in (("rows", softmax_bwd_rows_kernel, inductor.TILE_CONFIGS),
                                    ("cols", softmax_bwd_cols_kernel, inductor.TILE_CONFIGS)):
            variants.append((f"{name}{mode}", kernel,
                             dict(shape, RECOMPUTE_P=recompute, SUM_ROWS=COLUMN_SUM_ROWS),
                             tiles))
        for name, kernel, tiles, constexprs in gluon:
            variants.append((f"gluon {name}{mode}", kernel,
                             dict(shape, **constexprs, RECOMPUTE_P=recompute,
                                  SUM_ROWS=COLUMN_SUM_ROWS), tiles))
    # the half-precision path (VisionAttentionBlock under autocast, precision "medium"):
    # one product per matmul of bf16 / fp16 operands, P recomputed, q, k, v read as
    # views of the QKV projection [B,S,3E]
    embed_dim = NUM_HEADS * head_dim
    qkv_views = dict(QKV_BATCH_STRIDE=SEQ_LEN * 3 * embed_dim, QKV_HEAD_STRIDE=head_dim,
                     QKV_ROW_STRIDE=3 * embed_dim)
    for dtype in ("bf16", "fp16"):
        for name, kernel, tiles, constexprs in gluon:
            variants.append((f"gluon {name} recompute P {dtype}", kernel,
                             dict(shape, **dict(constexprs, PRODUCTS=1, **qkv_views),
                                  OPERAND_DTYPE=dtype, RECOMPUTE_P=True,
                                  SUM_ROWS=COLUMN_SUM_ROWS), tiles))
    # precision "highest": fp16x3 products on scaled fp16 halves, P given or recomputed
    for recompute in (False, True):
        mode = " recompute P" if recompute else ""
        for name, kernel, tiles, constexprs in gluon:
            variants.append((f"gluon {name}{mode} fp16 halves", kernel,
                             dict(shape, **constexprs, OPERAND_DTYPE="fp16 halves",
                                  RECOMPUTE_P=recompute, SUM_ROWS=COLUMN_SUM_ROWS), tiles))
    # and its GEMMs: the split GEMM on fp16 halves, K that of the weight gradients at
    # batch 32, operands with unit inner strides (as a launch specializes them); with
    # 64-bit offsets too, as operands of 2^31 elements or more take them
    import triton.language as tl
    offset_dtypes = (("", tl.int32), (" int64 offsets", tl.int64))
    for offsets, offset_dtype in offset_dtypes if head_dim == HEAD_DIM else ():
        variants.append((f"split gemm fp16 halves{offsets}", split_gemm_kernel,
                         dict(K=32 * SEQ_LEN, GROUP_M=GROUP_M, stride_ak=1, stride_bn=1,
                              OFFSET_DTYPE=offset_dtype, OPERAND_DTYPE="fp16 halves"),
                         inductor.GEMM_TILES))
    return variants


def _gluon_kernels(head_dim):
    """(name, kernel, tiles, constexprs) of the Gluon kernels at head_dim, where this
    Triton has Gluon."""
    try:
        from triton.experimental.gluon import language as gl
        from vitattn_bwd import softmax_bwd_gluon
        from vitattn_bwd.kernels import softmax_bwd_gluon as gluon_kernels
    except ImportError:
        return []
    # q, k, v halves contiguous [B,H,S,D]
    constexprs = dict(PRODUCTS=3, OPERAND_SMEM=gl.NVMMASharedLayout.get_default_for(
        [64, head_tile(head_dim)], gl.bfloat16),
        QKV_BATCH_STRIDE=NUM_HEADS * SEQ_LEN * head_dim, QKV_HEAD_STRIDE=SEQ_LEN * head_dim,
        QKV_ROW_STRIDE=head_dim)
    return [("rows", gluon_kernels.softmax_bwd_rows_kernel,
             softmax_bwd_gluon.rows_tiles(head_dim),
             dict(constexprs, PREFETCH=softmax_bwd_gluon.ROWS_PREFETCH)),
            ("cols", gluon_kernels.softmax_bwd_cols_kernel,
             softmax_bwd_gluon.cols_tiles(head_dim),
             dict(constexprs, PREFETCH=softmax_bwd_gluon.COLS_PREFETCH))]


SWEEP = [TileConfig(m, n, w, s) for (m, n), w, s in itertools.product(
    [(64, 16), (64, 32), (64, 64), (32, 64), (128, 32), (128, 64)], (4, 8), (2, 3))]


def report(sweep=False, sass_dir=None, head_dim=HEAD_DIM):
    """(kernel name, tiles, configured?, Resources) of every configured tile (and of
    SWEEP's candidates too with sweep=True) at head_dim; with sass_dir, each one's SASS
    there."""
    for name, kernel, constexprs, configured in kernels(head_dim):
        sweeps = sweep and not _is_gluon(kernel) and isinstance(configured[0], TileConfig)
        candidates = tuple(SWEEP) if sweeps else ()
        for tiles in dict.fromkeys(configured + candidates):
            sass_file = None
            if sass_dir is not None:
                stem = "_".join([name.replace(" ", "_"), *map(str, tiles)])
                sass_file = Path(sass_dir, f"{stem}.sass")
            yield name, tiles, tiles in configured, sm90_resources(kernel, constexprs, tiles,
                                                                   sass_file)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true",
                        help="also compile the candidate tiles in SWEEP")
    parser.add_argument("--json", action="store_true", help="one JSON list, no table")
    parser.add_argument("--sass", type=Path, metavar="DIR",
                        help="also write each kernel's SASS into DIR")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM,
                        help=f"the attention kernels' head dim (default {HEAD_DIM}; "
                             "others compile the attention kernels only)")
    args = parser.parse_args()
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    if args.json:
        print(json.dumps([[name, list(tiles), configured, resources._asdict()]
                          for name, tiles, configured, resources in report(args.sweep, args.sass,
                                                                              args.head_dim)]))
        return
    print(f"{'kernel':24} {'tiles (attention: m, n, warps, stages)':38} {'regs':>5} {'spill B':>8} "
          f"{'smem KB':>8} {'HGMMA':>6} {'HMMA':>5} {'waits':>6} {'L2 pf':>6}   "
          "(* = configured)")
    for name, tiles, configured, r in report(args.sweep, args.sass, args.head_dim):
        print(f"{name:24} {'*' if configured else ' '}{tuple(tiles)!s:37} {r.registers:5} "
              f"{r.spill_stores:8} {r.shared_bytes / 1024:8.1f} {r.hgmma:6} {r.hmma:5} "
              f"{r.waits:6} {r.l2_prefetches:6}", flush=True)


if __name__ == "__main__":
    main()
