"""deterministic_sdpa where no GPU runs its kernels: the shapes and dtypes its operators'
fake implementations promise (what torch.compile traces with), eager calls through its
autograd.Function, where it runs, where the block takes it, and its refusal of double
backward."""
import pytest
import torch

from vitattn_bwd import (VisionAttentionBlock, attention_bwd_ws, attention_fwd,
                         deterministic_sdpa, routing)
from vitattn_bwd.layout import merge_heads, qkv_heads

BATCH, SEQ, HEADS, HEAD_DIM = 2, 17, 4, 64
EMBED = HEADS * HEAD_DIM


def test_fake_shapes_and_dtypes():
    qkv = torch.empty(BATCH, SEQ, 3 * EMBED, dtype=torch.bfloat16, device="meta")
    attn, lse = torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, HEADS)
    assert attn.shape == (BATCH, SEQ, EMBED) and attn.dtype == torch.bfloat16
    assert lse.shape == (BATCH, HEADS, SEQ) and lse.dtype == torch.float32
    grad_qkv = torch.ops.vitattn_bwd.sdpa_ws_bwd(attn, qkv, attn, lse, HEADS)
    assert grad_qkv.shape == qkv.shape and grad_qkv.dtype == torch.bfloat16


def test_supported_on_hopper_only_in_half_dtypes_at_head_dim_64():
    cpu = torch.device("cpu")
    assert not deterministic_sdpa.supported(cpu, torch.bfloat16, 64)
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert deterministic_sdpa.supported(cuda, torch.bfloat16, 64) == hopper
    assert not deterministic_sdpa.supported(cuda, torch.float32, 64)
    assert not deterministic_sdpa.supported(cuda, torch.bfloat16, 72)


def test_cudnn_forward_only_on_cuda_with_cudnn_9_and_its_sdpa_backend_on(monkeypatch):
    """cuDNN's attention forward is taken on CUDA with cuDNN 9 or later while the user
    leaves cuDNN and its SDPA backend on; flash's otherwise."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    assert attention_fwd.cudnn_forward_runs(cuda)
    assert not attention_fwd.cudnn_forward_runs(torch.device("cpu"))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8907)
    assert not attention_fwd.cudnn_forward_runs(cuda)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert not attention_fwd.cudnn_forward_runs(cuda)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    with torch.backends.cudnn.flags(enabled=False):
        assert not attention_fwd.cudnn_forward_runs(cuda)
    assert attention_fwd.cudnn_forward_runs(cuda)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert not attention_fwd.cudnn_forward_runs(cuda)


def test_double_backward_is_refused_by_name():
    """With create_graph=True autograd runs the backward formula with grad mode on: it
    raises rather than return a gradient without a graph (a silently wrong second
    derivative)."""
    with torch.enable_grad(), pytest.raises(RuntimeError, match="double backward"):
        deterministic_sdpa._backward(None, None, None)


def _sdpa(qkv, num_heads=HEADS):
    """attn [B,S,E]: torch's SDPA of qkv [B,S,3E]'s heads, with its autograd."""
    q, k, v = qkv_heads(qkv, num_heads)
    return merge_heads(torch.nn.functional.scaled_dot_product_attention(q, k, v))


def _sdpa_implementations(calls):
    """Stand-ins for the operators' CUDA implementations on the CPU (torch's SDPA
    forward, its autograd for the backward), which record their calls."""
    def forward(qkv, num_heads):
        calls.append("forward")
        return _sdpa(qkv, num_heads), torch.zeros(qkv.shape[0], num_heads, qkv.shape[1])

    def backward(grad_attn, qkv, attn, lse, num_heads):
        calls.append("backward")
        leaf = qkv.detach().requires_grad_()
        with torch.enable_grad():
            return torch.autograd.grad(_sdpa(leaf, num_heads), leaf, grad_attn)[0]
    return forward, backward


def test_eager_calls_run_the_implementations_through_an_autograd_function(monkeypatch):
    """An eager call runs the forward and backward implementations directly (an
    autograd.Function, not the dispatcher: the operators have no CPU kernel, so a call
    through them would fail here): SDPA's gradient, and double backward refused."""
    calls = []
    forward, backward = _sdpa_implementations(calls)
    monkeypatch.setattr(deterministic_sdpa, "sdpa_ws_fwd", forward)
    monkeypatch.setattr(deterministic_sdpa, "sdpa_ws_bwd", backward)
    torch.manual_seed(0)
    qkv = torch.randn(BATCH, SEQ, 3 * EMBED, dtype=torch.float64, requires_grad=True)
    grad_attn = torch.randn(BATCH, SEQ, EMBED, dtype=torch.float64)
    attn = deterministic_sdpa.attention(qkv, HEADS)
    grad_qkv, = torch.autograd.grad(attn, qkv, grad_attn)
    expected = _sdpa(qkv)
    torch.testing.assert_close(attn, expected.detach())
    torch.testing.assert_close(grad_qkv, torch.autograd.grad(expected, qkv, grad_attn)[0])
    assert calls == ["forward", "backward"]
    attn = deterministic_sdpa.attention(qkv, HEADS)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(attn, qkv, grad_attn, create_graph=True)


def test_a_backward_traced_by_compiled_autograd_calls_the_backward_operator(monkeypatch):
    """Under compiled autograd (dynamo tracing the backward of an eager forward) the
    Function's backward is the backward operator, opaque to dynamo, not the launcher's
    Python; given a CPU kernel here for the test, it computes SDPA's gradient."""
    from torch._dynamo import compiled_autograd
    calls = []
    forward, backward = _sdpa_implementations(calls)
    monkeypatch.setattr(deterministic_sdpa, "sdpa_ws_fwd", forward)
    monkeypatch.setattr(deterministic_sdpa, "sdpa_ws_bwd", backward)
    cpu_kernel = torch.library.Library("vitattn_bwd", "IMPL")
    try:
        cpu_kernel.impl("sdpa_ws_bwd", lambda *args: (calls.append("operator"),
                                                      backward(*args))[1], "CPU")
        torch.manual_seed(0)
        qkv = torch.randn(BATCH, SEQ, 3 * EMBED, requires_grad=True)
        grad_attn = torch.randn(BATCH, SEQ, EMBED)
        attn = deterministic_sdpa.attention(qkv, HEADS)
        with compiled_autograd._enable(lambda graph: torch.compile(graph, backend="eager")):
            attn.backward(grad_attn)
    finally:
        cpu_kernel._destroy()
    assert calls == ["forward", "operator", "backward"]
    torch.testing.assert_close(qkv.grad,
                               torch.autograd.grad(_sdpa(qkv), qkv, grad_attn)[0])


def test_inside_torch_compile_the_forward_is_the_operator():
    """A compiled caller's graph holds the forward operator (opaque to dynamo, with its
    fake implementation; traced here on the meta device), not the Function."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    qkv = torch.empty(BATCH, SEQ, 3 * EMBED, dtype=torch.bfloat16, device="meta",
                      requires_grad=True)
    compiled = torch.compile(lambda t: deterministic_sdpa.attention(t, HEADS) * 2,
                             backend=backend, fullgraph=True)
    assert compiled(qkv).shape == (BATCH, SEQ, EMBED)
    targets = {node.target for node in graphs[0].graph.nodes}
    assert torch.ops.vitattn_bwd.sdpa_ws_fwd in targets


@pytest.fixture
def attention_calls(monkeypatch):
    """Where the stock route would take deterministic_sdpa's operators, as on a Hopper GPU
    (supported: True; 132 SMs), the dtypes of the qkv it hands them, computed here by
    SDPA."""
    calls = []

    def recorded(qkv, num_heads):
        calls.append(qkv.dtype)
        return _sdpa(qkv, num_heads)
    monkeypatch.setattr(deterministic_sdpa, "supported", lambda *args: True)
    monkeypatch.setattr(deterministic_sdpa, "_sm_count", lambda device: 132)
    monkeypatch.setattr(deterministic_sdpa, "attention", recorded)
    return calls


def _step(block, x, requires_grad=True):
    x = x.clone().requires_grad_(requires_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    if y.requires_grad:
        y.float().sum().backward()
    return y


@pytest.mark.usefixtures("deterministic")
def test_the_operators_run_only_where_a_deterministic_backward_is_asked_for(
        attention_calls, monkeypatch):
    """Under the flag, with gradients to compute: the operators, in the autocast dtype.
    Not under warn_only (SDPA's faster backward then only warns), without gradients
    (no_grad, or nothing requiring grad), for an empty batch (flash refuses zero
    tokens), or for a float64 block (autocast leaves float64 alone). (Batches too small
    for the operators without the flag, as the test's own.)"""
    monkeypatch.setattr(routing, "OUR_ATTENTION_MIN_BATCH", BATCH + 1)
    torch.manual_seed(0)
    block = VisionAttentionBlock(EMBED, HEADS)
    x = torch.randn(BATCH, SEQ, EMBED)
    _step(block, x)
    assert attention_calls == [torch.bfloat16]
    attention_calls.clear()
    torch.use_deterministic_algorithms(True, warn_only=True)
    _step(block, x)
    torch.use_deterministic_algorithms(True)
    with torch.no_grad():
        _step(block, x)
    block.requires_grad_(False)
    _step(block, x, requires_grad=False)
    block.requires_grad_(True)
    assert _step(block, x[:0]).shape == (0, SEQ, EMBED)
    _step(block.double(), x.double())
    assert attention_calls == []


@pytest.mark.usefixtures("deterministic")
def test_sequences_longer_than_the_kernel_takes_keep_sdpa(attention_calls, monkeypatch):
    """Where the backward's launcher would refuse the shapes (a head's key blocks more
    than the SMs), the block keeps SDPA, under the flag too, rather than fail in the
    backward."""
    monkeypatch.setattr(deterministic_sdpa, "_sm_count", lambda device: 1)
    block = VisionAttentionBlock(EMBED, HEADS)
    _step(block, torch.randn(BATCH, 128, EMBED))
    assert attention_calls == [torch.bfloat16]
    _step(block, torch.randn(BATCH, 129, EMBED))
    assert attention_calls == [torch.bfloat16]


def test_where_the_operators_do_not_run_a_dynamic_batch_compiles_once():
    """On a device without the operators (the CPU here) the route reads no batch size, so
    a block compiled with a dynamic batch under bf16 autocast is not recompiled across
    routing.OUR_ATTENTION_MIN_BATCH."""
    from torch._dynamo.testing import CompileCounter
    torch.manual_seed(0)
    block = VisionAttentionBlock(EMBED, HEADS)
    counter = CompileCounter()
    compiled = torch.compile(block, backend=counter, dynamic=True)
    _step(compiled, torch.randn(2, SEQ, EMBED))
    frames = counter.frame_count
    for batch in (routing.OUR_ATTENTION_MIN_BATCH + 1, 3):
        _step(compiled, torch.randn(batch, SEQ, EMBED))
    assert counter.frame_count == frames


@pytest.mark.parametrize("min_batch", [BATCH, BATCH + 1])
def test_without_the_flag_the_operators_run_in_bf16_training_steps_from_a_batch_size(
        attention_calls, monkeypatch, min_batch):
    """Without the flag: the operators in bf16 autocast training steps of at least
    routing.OUR_ATTENTION_MIN_BATCH images (where they were measured faster than SDPA's
    backward); SDPA in fp16 (not measured), without gradients, and below that batch."""
    monkeypatch.setattr(routing, "OUR_ATTENTION_MIN_BATCH", min_batch)
    torch.manual_seed(0)
    block = VisionAttentionBlock(EMBED, HEADS)
    x = torch.randn(BATCH, SEQ, EMBED)
    _step(block, x)
    with torch.no_grad():
        _step(block, x)
    with torch.autocast("cpu", dtype=torch.float16):
        block(x.clone().requires_grad_()).float().sum().backward()
    assert attention_calls == ([torch.bfloat16] if BATCH >= min_batch else [])


@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("warn_only", [False, True])
def test_under_the_flag_the_block_stays_one_graph(attention_calls, warn_only):
    """What the block reads of the flag (warn_only too) traces into torch.compile's
    graph without a break. (torch 2.11's dynamo breaks the graph at a plain
    torch.is_deterministic_algorithms_warn_only_enabled() call, which torch 2.13's
    traces: on the CPU this passes either way, and the compiled GPU test in
    test_gpu_deterministic_sdpa.py is the one that catches it on torch 2.11.)"""
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    block = VisionAttentionBlock(EMBED, HEADS)
    x = torch.randn(BATCH, SEQ, EMBED, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert attention_calls == ([] if warn_only and BATCH < routing.OUR_ATTENTION_MIN_BATCH
                               else [torch.bfloat16])


def test_supported_where_the_warp_specialized_kernel_compiles(monkeypatch):
    """On a machine that says its CUDA device is an sm_90: the operators run in bf16 and
    fp16 at head dim 64 where triton compiles the kernel, and not where it does not
    (compile_failure's reason), whatever the two-pass Gluon kernels do. The compile's
    verdict is stood in for (see test_attention_bwd_ws's named_once test for why)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention_bwd_ws, "compile_failure", lambda: None)
    cuda = torch.device("cuda")
    assert deterministic_sdpa.supported(cuda, torch.bfloat16, 64)
    assert deterministic_sdpa.supported(cuda, torch.float16, 64)
    assert not deterministic_sdpa.supported(cuda, torch.float32, 64)
    assert not deterministic_sdpa.supported(cuda, torch.bfloat16, 72)
    monkeypatch.setattr(attention_bwd_ws, "compile_failure", lambda: "AttributeError: ...")
    assert not deterministic_sdpa.supported(cuda, torch.bfloat16, 64)
