"""The warp-specialized passes with P given (attention_bwd_ws.launch_rows_ws and
launch_cols_ws, kernels/attention_passes_ws.py) compiled for the H100/H200 (sm_90) here
on the CPU, with the installed triton and with the newest one (.ci/run): their products
stay in flight between two waits a tile, the producer warp gives its registers to the
consumers, and nothing spills. And their launchers' argument checks, which run before
any device work. Their values against float64 are tests/test_gpu_gluon.py's (GPU)."""

import pytest
import torch

from vitattn_bwd import attention_bwd_ws

from .helpers import H200_SHARED_MEMORY, sm90_compile_report, triton_environments

# registers of an SM (and of one thread block) on the H100 / H200
SM_REGISTERS = 65536


@pytest.fixture(scope="module", params=list(triton_environments()))
def resources(request):
    """[(pass, tiles, heads_in_rows, resources)] from scripts/time_core_passes_ws.py
    --sm90."""
    report = sm90_compile_report(["scripts/time_core_passes_ws.py", "--sm90"],
                                 triton_environments()[request.param], timeout=900)
    return [(name, attention_bwd_ws.PassWsTiles(*tiles), heads_in_rows, r)
            for name, tiles, heads_in_rows, r in report]


def test_every_configuration_of_both_passes_is_compiled_for_both_layouts(resources):
    assert {(name, tiles, heads_in_rows) for name, tiles, heads_in_rows, _ in resources} == {
        (name, tiles, heads_in_rows)
        for name, configurations in (("rows", attention_bwd_ws.ROWS_WS_TILES),
                                     ("cols", attention_bwd_ws.COLS_WS_TILES))
        for tiles in configurations for heads_in_rows in (True, False)}


def test_products_are_asynchronous(resources):
    """Three matmuls of three products per tile of the walked side (dP or dP^T over head
    dim 64: 12 HGMMAs of k = 16 a warpgroup; the other two over 32 rows: 6 each), in
    flight between three waits in the whole kernel (two a tile, one after the walk),
    and ptxas did not serialize them (its C75xx notes: with the slot's release branched
    on rather than predicated, triton 3.9's ptxas put a wait after every HGMMA)."""
    for name, tiles, heads_in_rows, r in resources:
        assert r["hgmma"] >= 24 and r["waits"] <= 3, (name, tiles, heads_in_rows, r)
        assert r["serialized"] == [], (name, tiles, heads_in_rows, r)


def test_registers_move_from_the_producer_to_the_consumers(resources):
    for _, tiles, heads_in_rows, r in resources:
        assert tiles.worker_registers in r["setmaxnreg"], (tiles, r)
        assert max(r["setmaxnreg"]) >= 232, (tiles, r)


def test_configurations_fit_one_program_per_sm_without_spills(resources):
    for name, tiles, heads_in_rows, r in resources:
        assert tiles.maxnreg * r["threads"] <= SM_REGISTERS, (tiles, r)
        assert r["shared_bytes"] <= H200_SHARED_MEMORY, (tiles, r)
        assert r["spill_stores"] == 0 and r["walk_spills"] == 0, (name, tiles, r)


def test_p_by_producer_moves_p_into_the_producers_copies(resources):
    """With p_by_producer the producer copies each step's [128, 32] P tile, 32 4-byte
    cp.async a thread (4 chunks of 8), and arrives once on the slot's mbarrier when they
    land; without it nothing is copied by cp.async (the consumers load P themselves)."""
    for name, tiles, heads_in_rows, r in resources:
        expected = (32, 1) if tiles.p_by_producer else (0, 0)
        assert (r["cp_async_copies"], r["cp_async_arrives"]) == expected, (name, tiles, r)


def _inputs(batch=1, heads=2, seq_len=5, head_dim=64, dtype=torch.bfloat16):
    """Arguments of either pass: `q_hi`, `q_lo` stand for k's halves in the rows pass."""
    def halves(*shape):
        return torch.randn(*shape).to(dtype), torch.randn(*shape).to(dtype)
    grad_attn_hi, grad_attn_lo = halves(batch, seq_len, heads * head_dim)
    q_hi, q_lo = halves(batch, heads, seq_len, head_dim)
    v_hi, v_lo = halves(batch, heads, seq_len, head_dim)
    return dict(probs=torch.rand(batch, heads, seq_len, seq_len), grad_attn_hi=grad_attn_hi,
                grad_attn_lo=grad_attn_lo, q_hi=q_hi, q_lo=q_lo, v_hi=v_hi, v_lo=v_lo,
                delta=torch.zeros(batch, heads, seq_len), scale=0.125)


def _launch(rows_pass, probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, v_hi, v_lo, delta,
            scale, tiles=None):
    """The pass's launcher on these arguments, outputs None (checked after the rest)."""
    if rows_pass:
        attention_bwd_ws.launch_rows_ws(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, v_hi,
                                        v_lo, delta, None, None, None, scale,
                                        tiles or attention_bwd_ws.ROWS_WS_TILES[0])
    else:
        attention_bwd_ws.launch_cols_ws(probs, grad_attn_hi, grad_attn_lo, q_hi, q_lo, v_hi,
                                        v_lo, delta, None, None, None, scale,
                                        tiles or attention_bwd_ws.COLS_WS_TILES[0])


@pytest.mark.parametrize("rows_pass", [True, False], ids=["rows", "cols"])
@pytest.mark.parametrize("change, message", [
    (lambda i: dict(i, probs=torch.rand(1, 2, 5)), r"probs must be P, contiguous float32"),
    (lambda i: dict(i, probs=i["probs"].double()), r"probs must be P, contiguous float32"),
    (lambda i: dict(i, probs=i["probs"].transpose(-1, -2)), r"probs must be P, contiguous"),
    (lambda i: _inputs(head_dim=128), "head_dim must be 64, got 128"),
    (lambda i: _inputs(dtype=torch.float16), "the operands must be given as bf16 halves"),
    (lambda i: dict(i, v_lo=i["v_lo"].float()), "the operands must be given as bf16"),
    (lambda i: dict(i, grad_attn_lo=i["grad_attn_lo"].half()),
     "the operands must be given as bf16"),
    (lambda i: dict(i, v_lo=i["v_lo"].transpose(-1, -2).contiguous().transpose(-1, -2)),
     r"[qk] and v \(hi and lo\) must share one shape and strides"),
    (lambda i: dict(i, v_hi=i["v_hi"][:, :, :4], v_lo=i["v_lo"][:, :, :4]),
     r"[qk] and v \(hi and lo\) must share one shape"),
    (lambda i: dict(i, grad_attn_lo=i["grad_attn_lo"][:, :4]),
     r"grad_attn_lo must be contiguous \[B,S,E\]"),
    (lambda i: dict(i, grad_attn_hi=i["grad_attn_hi"].transpose(1, 2).contiguous()
                    .transpose(1, 2)), r"grad_attn_hi must be contiguous \[B,S,E\]"),
    (lambda i: dict(i, delta=i["delta"][..., :4]), r"delta must be contiguous float32"),
])
def test_bad_arguments_are_named(rows_pass, change, message):
    with pytest.raises(ValueError, match=message):
        _launch(rows_pass, **change(_inputs()))


@pytest.mark.parametrize("rows_pass, tiles, message", [
    (True, attention_bwd_ws.PassWsTiles(128, 32, num_stages=1), "block_m 128, 8 warps and "
                                                                "at least 2 stages"),
    (True, attention_bwd_ws.PassWsTiles(64, 32), "block_m 128"),
    (False, attention_bwd_ws.PassWsTiles(32, 128, num_stages=1), "block_n 128, 8 warps and "
                                                                 "at least 2 stages"),
    (False, attention_bwd_ws.PassWsTiles(32, 64), "block_n 128"),
    (False, attention_bwd_ws.PassWsTiles(32, 128, num_warps=4), "block_n 128, 8 warps"),
])
def test_tiles_outside_the_family_are_refused(rows_pass, tiles, message):
    """A ring of one slot would hang (the consumers wait for a tile before giving back
    the slot it needs); the own side is 128 rows of two consumer warpgroups."""
    with pytest.raises(ValueError, match="^tiles must have " + message):
        _launch(rows_pass, **_inputs(), tiles=tiles)


@pytest.mark.parametrize("rows_pass", [True, False], ids=["rows", "cols"])
def test_checked_arguments_reach_the_launch(rows_pass):
    """Arguments that pass the checks get as far as the kernel's launch (here, on the
    CPU, triton's refusal of CPU tensors or the missing GPU: nothing our checks raise)."""
    with pytest.raises(Exception) as raised:
        _launch(rows_pass, **_inputs())
    assert not isinstance(raised.value, ValueError), raised.value
