"""Every Triton and Gluon kernel (the attention forward, both backward passes, the
LayerNorm backward, the split GEMM), with every tile configuration we launch or let
max-autotune choose, compiled for the H100/H200 (sm_90) here on the CPU (Triton's front
end and the ptxas it runs; no GPU), with the installed triton and with the newest one
(.ci/run): it fits the 227 KB of shared memory a block may use and spills no
registers (but SPILL_BYTES). A spilling tile runs at a fraction of the tensor cores' rate
(docs/performance.md), and nothing else would notice."""

import pytest

from .helpers import H200_SHARED_MEMORY, sm90_compile_report, triton_environments

pytestmark = pytest.mark.sm90_compile


@pytest.fixture(scope="module", params=list(triton_environments()))
def resources(request):
    """scripts/kernel_resources.py --json with each triton (helpers.triton_environments)."""
    return sm90_compile_report(["scripts/kernel_resources.py", "--json"],
                               triton_environments()[request.param], timeout=600)


def test_every_configured_tile_is_compiled(resources):
    names = {name for name, *_ in resources}
    passes = {"rows", "cols", "rows recompute P", "cols recompute P"}
    one_product = {f"gluon {name} recompute P {dtype}" for name in ("rows", "cols")
                   for dtype in ("bf16", "fp16")}
    fp16_halves = {f"gluon {name} fp16 halves" for name in passes}     # "highest"
    split_gemm = {"split gemm fp16 halves", "split gemm fp16 halves int64 offsets"}
    assert names == ({"forward", "layer norm"} | split_gemm | passes
                     | {f"gluon {name}" for name in passes} | one_product | fp16_halves)
    assert all(configured for *_, configured, _ in resources)


# The one spill left: 4 bytes with triton 3.9 (none with 3.6) since the Triton passes
# decode their block and head from a 1-D grid (kernels/softmax_bwd.program_block).
SPILL_BYTES = {("cols recompute P", (64, 32, 4, 3)): 4}


def test_configured_tiles_fit_sm90_without_spills(resources):
    for name, tiles, _, r in resources:
        assert r["shared_bytes"] <= H200_SHARED_MEMORY, (name, tiles, r)
        assert r["spill_stores"] <= SPILL_BYTES.get((name, tuple(tiles)), 0), (name, tiles, r)


def test_tiles_of_64_rows_use_warpgroup_mma(resources):
    """Tiles whose MMAs have 64+ rows per warpgroup run on Hopper's wgmma (HGMMA)."""
    for name, tiles, _, r in resources:
        if name == "layer norm":                   # no matrix products
            continue
        if name.startswith("split gemm"):              # GemmTiles: BLOCK_K third
            block_m, block_n, _, num_warps, _ = tiles
        else:
            block_m, block_n, num_warps, _ = tiles
        mma_rows = block_n if name.startswith("cols") else block_m
        if mma_rows // (num_warps // 4) >= 64:
            assert r["hgmma"] > 0, (name, block_m, block_n, r)


def test_gluon_kernels_wait_for_their_products_three_times(resources):
    """The point of the Gluon kernels: their wgmma products are asynchronous, and the
    program waits for them three times per tile (the accumulators' last wait included),
    not after each of their 9-12 products (3-4 with one product per matmul, of half-
    precision operands)."""
    gluon = [(name, r) for name, _, _, r in resources if name.startswith("gluon")]
    assert gluon
    for name, r in gluon:
        one_product = name.endswith(("bf16", "fp16"))
        assert r["hgmma"] >= (8 if one_product else 24) and r["waits"] <= 3, (name, r)


def test_gluon_kernels_prefetch_p_when_it_is_given(resources):
    """With P given, the Gluon kernels ask the L2 for P tiles ahead of their register
    loads (prefetch.global.L2 -> CCTL.E.PF2 in the SASS: the cols pass ran 13-15% faster
    for it on the H200); with P recomputed there is no P to ask for."""
    for name, _, _, r in resources:
        if name.startswith("gluon"):
            assert (r["l2_prefetches"] > 0) == ("recompute" not in name), (name, r)


def test_kernels_compute_in_float32(resources):
    """No float64 arithmetic in the SASS but the LayerNorm kernel's one add of norm_eps,
    which Inductor hands the operator as a float64 scalar: uncast, it made all of that
    kernel's row math float64 (674 DADD/DMUL/DFMA at 4 x 4 rows; found in session 10)."""
    for name, tiles, _, r in resources:
        assert r["fp64_ops"] <= (8 if name == "layer norm" else 0), (name, tiles, r)


@pytest.fixture(scope="module")
def padded_resources():
    """scripts/kernel_resources.py --json --head-dim 72 (SigLIP so400m's) with the
    installed triton: the attention kernels in 128-wide zero-padded head tiles."""
    return sm90_compile_report(["scripts/kernel_resources.py", "--json", "--head-dim", "72"],
                               triton_environments()["installed triton"], timeout=900)


def test_gluon_kernels_at_a_padded_head_dim(padded_resources):
    """At head dim 72 the Gluon kernels' configured tiles (softmax_bwd_gluon.rows_tiles /
    cols_tiles) fit the shared memory, keep the three waits per tile of head dim 64, and
    spill nothing, but for the 48 bytes of the cols pass of bf16x3 with P given (the
    contract's mode, at head dim 64 in the benchmark; softmax_bwd_gluon.WIDE_COLS_TILES)."""
    gluon = [(name, r) for name, _, _, r in padded_resources if name.startswith("gluon")]
    assert len(gluon) == 12                    # six modes x two passes x one tile each
    for name, r in gluon:
        assert r["shared_bytes"] <= H200_SHARED_MEMORY and r["waits"] <= 3, (name, r)
        assert r["spill_stores"] <= (48 if name == "gluon cols" else 0), (name, r)
