"""The stock route under torch.use_deterministic_algorithms(True) on a Hopper GPU: under
autocast at precision None the block's attention runs deterministic_sdpa's (torch's
cuDNN forward, the warp-specialized backward: an autograd.Function in eager calls, the
operators in a compiled graph, bit for bit the same), repeats bit for bit, is as close
to float64 as the stock block under the same flag, compiles into one graph, and replays
in a CUDA graph; without the flag it runs them in bf16 training steps from
routing.OUR_ATTENTION_MIN_BATCH images."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vitattn_bwd import VisionAttentionBlock, deterministic_sdpa, routing
from vitattn_bwd.attention_fwd import attention_fwd_half, cudnn_forward_runs
from vitattn_bwd.layout import qkv_heads

from .helpers import block_against_stock, block_step, relative_errors

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32", "deterministic")]

SEQ, EMBED, HEADS, BATCH = 577, 1024, 16, 2


@pytest.fixture(autouse=True)
def hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized backward needs a Hopper GPU")


@pytest.fixture
def attention_calls(monkeypatch):
    """The number of deterministic_sdpa.attention calls the block makes."""
    calls = []
    original = deterministic_sdpa.attention

    def recorded(qkv, num_heads):
        calls.append(qkv.dtype)
        return original(qkv, num_heads)
    monkeypatch.setattr(deterministic_sdpa, "attention", recorded)
    return calls


def _block():
    torch.manual_seed(0)
    block = VisionAttentionBlock(EMBED, HEADS).cuda()
    with torch.no_grad():                   # LayerNorm and biases off their init
        for p in block.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return block


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_block_under_the_flag_is_as_close_to_float64_as_stock(attention_calls,
                                                              autocast_dtype):
    block = _block()
    x = torch.randn(BATCH, SEQ, EMBED, device="cuda")
    grad_y = torch.randn_like(x)
    with torch.autocast("cuda", dtype=autocast_dtype):
        got, again, _, errors = block_against_stock(block, x, grad_y)
    assert attention_calls == [autocast_dtype, autocast_dtype]
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    for name, g, s, ours, theirs in errors:
        assert g.dtype == s.dtype, (name, g.dtype, s.dtype)
        assert ours <= 1.2 * theirs + 1e-5, (name, ours, theirs)


def test_compiled_block_under_the_flag_is_one_graph_within_bf16_rounding_of_eager():
    """The compiled block's one graph holds the operators (not SDPA), repeats bit for
    bit, and is within bf16 rounding of the eager block (Inductor fuses the ops around
    them differently)."""
    block = _block()
    x = torch.randn(BATCH, SEQ, EMBED, device="cuda")
    grad_y = torch.randn_like(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(block)(x)
        compiled = torch.compile(block, fullgraph=True)
        got = block_step(compiled, x, grad_y)
        again = block_step(compiled, x, grad_y)
        eager = block_step(block, x, grad_y)
    assert explained.graph_break_count == 0
    graphs = "".join(str(g.graph) for g in explained.graphs)
    assert "sdpa_ws_fwd" in graphs and "scaled_dot_product_attention" not in graphs
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    for name, err in zip(["y", "x"] + [n for n, _ in block.named_parameters()],
                         relative_errors(got, eager)):
        assert err < 2 ** -8, (name, err)


def test_without_the_flag_bf16_training_steps_from_the_batch_threshold_take_our_attention(
        attention_calls):
    """Without the flag, at routing.OUR_ATTENTION_MIN_BATCH images under bf16 autocast:
    deterministic_sdpa's attention, eager (as close to float64 as the stock block) and
    as the operators in the compiled block's one graph; below that batch and in fp16, SDPA."""
    torch.use_deterministic_algorithms(False)
    block = _block()
    batch = routing.OUR_ATTENTION_MIN_BATCH
    x = torch.randn(batch, SEQ, EMBED, device="cuda")
    grad_y = torch.randn_like(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, again, _, errors = block_against_stock(block, x, grad_y)
        assert attention_calls == [torch.bfloat16] * 2
        explained = torch._dynamo.explain(block)(x)
        calls = len(attention_calls)
        block_step(block, x[:batch - 1], grad_y[:batch - 1])
    with torch.autocast("cuda", dtype=torch.float16):
        block_step(block, x, grad_y)
    assert len(attention_calls) == calls
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    for name, g, s, ours, theirs in errors:
        assert ours <= 1.2 * theirs + 1e-5, (name, ours, theirs)
    assert explained.graph_break_count == 0
    assert "sdpa_ws_fwd" in "".join(str(g.graph) for g in explained.graphs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_block_on_a_gpu_that_is_not_the_current_one(attention_calls):
    """The backward operator launches on its tensors' GPU, not the current one: a block
    on cuda:1 while cuda:0 is current gives cuda:0's bits."""
    block = _block()
    x = torch.randn(BATCH, SEQ, EMBED, device="cuda")
    grad_y = torch.randn_like(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = block_step(block, x, grad_y)
        block.to("cuda:1")                  # cuda:0 stays current; autocast covers both
        got = block_step(block, x.to("cuda:1"), grad_y.to("cuda:1"))
    assert attention_calls == [torch.bfloat16, torch.bfloat16]
    assert all(g.device == torch.device("cuda:1") and torch.equal(g.cpu(), w.cpu())
               for g, w in zip(got, want))


def test_forward_is_cudnns_within_bf16_rounding_of_flash_and_flashs_where_cudnn_is_off():
    """On the H200 the forward operator runs cuDNN's attention: its output within bf16
    rounding of flash's and its log-sum-exp within 1e-5; with cuDNN's SDPA backend
    turned off (sdpa_kernel) it runs flash's, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(BATCH, SEQ, 3 * EMBED, device="cuda", generator=g,
                      dtype=torch.bfloat16)
    flash_attn, flash_lse = attention_fwd_half(*qkv_heads(qkv, HEADS), 0.125)
    assert cudnn_forward_runs(qkv.device)
    attn, lse = torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, HEADS)
    assert attn.shape == flash_attn.shape and lse.shape == flash_lse.shape
    assert (attn.float() - flash_attn.float()).abs().max() <= 2 ** -7
    assert (lse - flash_lse).abs().max() <= 1e-5
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert not cudnn_forward_runs(qkv.device)
        attn, lse = torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, HEADS)
    assert torch.equal(attn, flash_attn) and torch.equal(lse, flash_lse)


@pytest.mark.parametrize("batch", [1, 3])
def test_eager_function_gives_the_operators_bits(batch):
    """Eager calls (the autograd.Function) and the operators (what a compiled graph
    runs): the same output and gradient, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    qkv = torch.randn(batch, SEQ, 3 * EMBED, device="cuda", generator=g,
                      dtype=torch.bfloat16)
    grad_attn = torch.randn(batch, SEQ, EMBED, device="cuda", generator=g,
                            dtype=torch.bfloat16)
    results = []
    for attention in (deterministic_sdpa.attention,
                      lambda t, heads: torch.ops.vitattn_bwd.sdpa_ws_fwd(t, heads)[0]):
        leaf = qkv.clone().requires_grad_()
        attn = attention(leaf, HEADS)
        results.append((attn, torch.autograd.grad(attn, leaf, grad_attn)[0]))
    (attn, grad_qkv), (op_attn, op_grad_qkv) = results
    assert torch.equal(attn, op_attn) and torch.equal(grad_qkv, op_grad_qkv)


def test_eager_calls_replay_in_a_cuda_graph():
    """The backward's cooperative launch (a persistent grid) captured and replayed: the
    eager call's bits. The captured step takes a leaf of its own, made on the capture's
    side stream: a leaf used on the default stream keeps its gradient accumulator there,
    and capture then fails on the engine's wait for that stream, whatever the ops."""
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(BATCH, SEQ, 3 * EMBED, device="cuda", generator=g,
                      dtype=torch.bfloat16)
    grad_attn = torch.randn(BATCH, SEQ, EMBED, device="cuda", generator=g,
                            dtype=torch.bfloat16)

    def step(leaf):
        attn = deterministic_sdpa.attention(leaf, HEADS)
        return attn, torch.autograd.grad(attn, leaf, grad_attn)[0]
    eager = step(qkv.clone().requires_grad_())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static = qkv.clone().requires_grad_()
        step(static)                                       # warm-up off the main stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            captured = step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))


def test_double_backward_is_refused_by_name():
    """create_graph=True through the block's attention: a RuntimeError naming double backward,
    as torch's own flash backward refuses it, not a second derivative without a graph."""
    block = _block()
    x = torch.randn(BATCH, SEQ, EMBED, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = block(x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
