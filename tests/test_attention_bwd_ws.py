"""The warp-specialized one-pass attention-core backward (attention_bwd_ws.py) compiled
for the H100/H200 (sm_90) here on the CPU, with the installed triton and with the newest
one (.ci/run): what makes it a warp-specialized kernel shows in its machine code. And
its launcher's argument checks, which run before any device work."""

import pytest
import torch

from vitattn_bwd import attention_bwd_ws

from .helpers import (H200_SHARED_MEMORY, sm90_compile_report, triton_environments,
                      triton_version_in)


# the sm90_compile mark on each param marks every test that takes the report
@pytest.fixture(scope="module", params=[pytest.param(label, marks=pytest.mark.sm90_compile)
                                        for label in triton_environments()])
def resources(request):
    """{tiles: resources} from scripts/time_kernels.py --kernel core_ws --sm90 with each
    triton."""
    report = sm90_compile_report(["scripts/time_kernels.py", "--kernel", "core_ws", "--sm90"],
                                 triton_environments()[request.param], timeout=900)
    return {attention_bwd_ws.WsTiles(*tiles): r for tiles, r in report}


def test_every_configuration_is_compiled(resources):
    assert set(resources) == set(attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES)


def test_products_are_asynchronous(resources):
    """Five products per query tile (S and dP over head dim 64, dV, dK and dQ over 128
    queries or keys: 4 or 8 HGMMAs of k = 16 each per warpgroup), all in flight between
    four waits in the whole kernel (three per tile, one after the walk), and ptxas did
    not serialize them (its C7512/C7514/C7515 notes, given for register shortage or for
    accumulators read while products are in flight)."""
    for tiles, r in resources.items():
        assert r["hgmma"] >= 24 and r["waits"] <= 4, (tiles, r)
        assert r["serialized"] == [], (tiles, r)


def test_registers_move_from_the_workers_to_the_consumers(resources):
    """setmaxnreg: the producer and dQ-writer warps take their configuration's few
    registers per thread, the consumers 224 or more."""
    for tiles, r in resources.items():
        assert tiles.worker_registers in r["setmaxnreg"], (tiles, r)
        assert tiles.worker_registers <= 56 and max(r["setmaxnreg"]) >= 224, (tiles, r)


# registers of an SM (and of one thread block) on the H100 / H200
SM_REGISTERS = 65536


def test_configured_tiles_fit_without_spills_in_the_walk(resources, request):
    """Every configuration's launch fits the register file (maxnreg x threads; at 184
    registers the 384 threads of two consumer warpgroups did not launch), and as many
    programs as its registers allow on an SM fit its shared memory with their 2 or 3
    ring stages. The configured tiles spill nothing in the consumers' walk over the
    query tiles with triton 3.6 (the GPU runs' triton), and at most 8 words in all
    (shared-memory addresses computed once, reloaded once per work item). Other tritons'
    ptxas choose other values to keep: with 3.9 up to 5 local loads a tile in the walk
    (L1 hits), with 3.8 none there and 13 words in all (torch 2.14.1's triton); their
    cost on a GPU is unmeasured (docs/performance.md). The candidates spill a few words
    more.
    """
    environment = triton_environments()[request.node.callspec.params["resources"]]
    gpu_runs_triton = triton_version_in(environment).startswith("3.6.")
    walk_spills, spill_bytes = (0, 32) if gpu_runs_triton else (5, 64)
    for tiles in attention_bwd_ws.TILES + attention_bwd_ws.CANDIDATE_TILES:
        r = resources[tiles]
        programs_per_sm = SM_REGISTERS // (tiles.maxnreg * r["threads"])
        assert programs_per_sm >= 1 and tiles.num_stages >= 2, (tiles, r)
        assert programs_per_sm * r["shared_bytes"] <= H200_SHARED_MEMORY, (tiles, r)
        if tiles in attention_bwd_ws.TILES:
            assert (r["walk_spills"] <= walk_spills
                    and r["spill_stores"] <= spill_bytes), (tiles, r)
        else:
            assert r["spill_stores"] <= 64, (tiles, r)


def _inputs(dtype=torch.bfloat16, batch=1, heads=2, seq_len=5, head_dim=64):
    qkv = torch.randn(batch, seq_len, 3 * heads * head_dim).to(dtype)
    q, k, v = (t.unflatten(-1, (heads, head_dim)).transpose(1, 2)
               for t in qkv.chunk(3, dim=-1))
    grad_attn = torch.randn(batch, seq_len, heads * head_dim).to(dtype)
    return dict(q=q, k=k, v=v, grad_attn=grad_attn, attn_output=grad_attn.clone(),
                lse=torch.randn(batch, heads, seq_len), scale=0.125)


def _misaligned(t):
    """A contiguous copy of t starting one element (2 bytes) past an aligned address."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("change, message", [
    (lambda i: dict(i, q=i["q"].float(), k=i["k"].float(), v=i["v"].float()),
     "q, k, v, grad_attn, attn_output must share one dtype"),
    (lambda i: dict(i, k=i["k"].contiguous()), "q, k, v must share strides"),
    (lambda i: dict(i, q=i["q"].transpose(-1, -2).contiguous().transpose(-1, -2),
                    k=i["k"].transpose(-1, -2).contiguous().transpose(-1, -2),
                    v=i["v"].transpose(-1, -2).contiguous().transpose(-1, -2)),
     "q, k, v must be contiguous"),
    (lambda i: dict(i, grad_attn=i["grad_attn"][:, :-1]), "grad_attn must be contiguous"),
    (lambda i: dict(i, lse=i["lse"].double()), "lse must be contiguous float32"),
    (lambda i: _inputs(head_dim=128), "head_dim must be 64, got 128"),
    (lambda i: _inputs(head_dim=48), "head_dim must be 64, got 48"),
    (lambda i: dict(i, grad_attn=_misaligned(i["grad_attn"])),
     "grad_attn must start at a 16-byte aligned address"),
])
def test_bad_arguments_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        attention_bwd_ws.launch(**change(_inputs()))


def test_rows_past_32_bit_indexing_are_refused():
    """B*H*S >= 2**31 rows would wrap the kernels' 32-bit row indices: refused before any
    launch (meta tensors: only the shapes are read)."""
    batch, heads, seq_len, head_dim = 2**15, 16, 4096, 64
    qkv = torch.empty(batch, seq_len, 3 * heads * head_dim, dtype=torch.bfloat16,
                      device="meta")
    q, k, v = (t.unflatten(-1, (heads, head_dim)).transpose(1, 2)
               for t in qkv.chunk(3, dim=-1))
    grad_attn = torch.empty(batch, seq_len, heads * head_dim, dtype=torch.bfloat16,
                            device="meta")
    lse = torch.empty(batch, heads, seq_len, device="meta")
    with pytest.raises(ValueError, match=r"batch \* heads \* seq_len .* must be below 2\*\*31"):
        attention_bwd_ws.launch(q, k, v, grad_attn, grad_attn, lse, 0.125)


def test_tiles_outside_the_family_are_refused():
    for tiles in (attention_bwd_ws.WsTiles(64, 128, 2, 168),
                  attention_bwd_ws.WsTiles(128, 64, 2, 168),
                  attention_bwd_ws.WsTiles(128, 128, 2, 168, grad_q_buffers=3),
                  attention_bwd_ws.WsTiles(128, 128, 2, 168, grad_q_swizzle=16)):
        with pytest.raises(ValueError, match="^tiles must have block_m and block_n 128, "
                                             "grad_q_buffers 1 or 2 and grad_q_swizzle"):
            attention_bwd_ws.launch(**_inputs(), tiles=tiles)
    with pytest.raises(ValueError, match="^a rotated walk needs a persistent grid"):
        attention_bwd_ws.launch(**_inputs(), tiles=attention_bwd_ws.WsTiles(
            128, 128, 2, 168, rotated_walk=True))


def test_the_grid_is_one_program_per_item_unless_persistent():
    """One program per (head, key block) item; a persistent configuration one per SM, or
    as many as asked, never more than there are items."""
    tiles = attention_bwd_ws.WsTiles(128, 128, 2, 168)
    persistent = tiles._replace(persistent=True)
    assert attention_bwd_ws.program_count(tiles, 960, sm_count=132) == 960
    with pytest.raises(ValueError, match="^programs must be a positive count"):
        attention_bwd_ws.program_count(tiles, 960, 132, programs=8)
    for programs in (0, -4):
        with pytest.raises(ValueError, match="^programs must be a positive count"):
            attention_bwd_ws.program_count(persistent, 960, 132, programs=programs)
    assert attention_bwd_ws.program_count(persistent, 960, sm_count=132) == 132
    assert attention_bwd_ws.program_count(persistent, 960, 132, programs=8) == 8
    assert attention_bwd_ws.program_count(persistent, 30, sm_count=132) == 30


def test_a_rotated_walk_needs_a_program_per_key_block_of_a_head():
    """With the rotated walk a key block waits on every other block of its head, so a
    grid with fewer programs than a head's key blocks is refused before any launch."""
    rotated = attention_bwd_ws.FASTEST_TILES
    assert rotated.rotated_walk and rotated.persistent
    assert attention_bwd_ws.program_count(rotated, 960, 132, programs=5,
                                          blocks_per_head=5) == 5
    assert attention_bwd_ws.program_count(rotated, 5, 132, blocks_per_head=5) == 5
    with pytest.raises(ValueError, match=r"^a rotated walk needs at least as many programs "
                                         r"as key blocks per head \(5\), got 4"):
        attention_bwd_ws.program_count(rotated, 960, 132, programs=4, blocks_per_head=5)


def test_fits_where_the_launcher_takes_the_shapes():
    """fits is True exactly where the launch would get past its shape checks: a head's
    key blocks (128 tokens each) no more than the SMs, rows below 2**31."""
    fastest = attention_bwd_ws.FASTEST_TILES
    assert attention_bwd_ws.fits(32, 16, 577, sm_count=132)
    assert attention_bwd_ws.fits(1, 1, 128 * 132, sm_count=132)
    assert not attention_bwd_ws.fits(1, 1, 128 * 132 + 1, sm_count=132)
    assert not attention_bwd_ws.fits(64, 16, 128 * 132 + 1, sm_count=132)
    assert attention_bwd_ws.fits(1, 1, 128 * 114, sm_count=114)
    assert not attention_bwd_ws.fits(2**15, 16, 4096, sm_count=132)   # 2**31 rows
    assert attention_bwd_ws.fits(2**15 - 1, 16, 4096, sm_count=132)
    for batch, heads, seq_len, sm_count in ((1, 1, 128 * 132 + 1, 132), (2, 3, 700, 4)):
        key_blocks = -(-seq_len // 128)
        with pytest.raises(ValueError, match="^a rotated walk needs"):
            attention_bwd_ws.program_count(fastest, key_blocks * batch * heads, sm_count,
                                           blocks_per_head=key_blocks)
        assert not attention_bwd_ws.fits(batch, heads, seq_len, sm_count)
    assert attention_bwd_ws.fits(2, 3, 640, sm_count=5)
    one_per_item = attention_bwd_ws.WsTiles(128, 128, 2, 168)
    assert attention_bwd_ws.fits(1, 1, 128 * 132 + 1, 132, tiles=one_per_item)


def test_the_fastest_launch_is_one_the_gpu_tests_and_timings_cover():
    """The deterministic attention's launch is one of the configurations that
    tests/test_gpu_attention_bwd_ws.py checks and scripts/time_kernels.py --kernel
    core_ws times, and one compiled without spills."""
    assert attention_bwd_ws.FASTEST_TILES in attention_bwd_ws.TILES
    assert attention_bwd_ws.FASTEST_TILES.persistent


def test_a_triton_that_cannot_compile_the_kernel_is_named_once(monkeypatch):
    """compile_failure: None where the kernel compiles, else the reason, with one
    RuntimeWarning naming the triton; deterministic_sdpa.supported then keeps SDPA's own
    backward. The compile is stood in for: in a process where Triton's interpreter has
    run a kernel (these CPU tests), Gluon's warp_specialize no longer compiles; the real
    sm_90 compile is the sm90_compile tests' (in subprocesses)."""
    monkeypatch.setattr(attention_bwd_ws, "compile_sm90", lambda tiles: None)
    attention_bwd_ws.compile_failure.cache_clear()
    assert attention_bwd_ws.compile_failure() is None

    def broken(tiles):
        raise AttributeError("module 'gluon' has no attribute 'warp_specialize'")
    monkeypatch.setattr(attention_bwd_ws, "compile_sm90", broken)
    attention_bwd_ws.compile_failure.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"triton \S+ \(AttributeError: .*"
                                                r"warp_specialize"):
            assert "warp_specialize" in attention_bwd_ws.compile_failure()
        assert "warp_specialize" in attention_bwd_ws.compile_failure()   # cached, silent
    finally:
        attention_bwd_ws.compile_failure.cache_clear()
