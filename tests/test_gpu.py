"""On a CUDA GPU: the compiled max-autotune path (Triton templates + bf16x3 GEMMs) at the
contract's 16 workloads, float64 spot checks, the exact mode, odd shapes, determinism,
the eager Triton kernels, the module's gradients at 577 tokens, no process-wide setting
changed under a concurrent user, and a soak test."""
import threading

import pytest
import torch

import vitattn_bwd
from vitattn_bwd import VisionAttentionBlock, contract, reference, softmax_bwd
from vitattn_bwd.workloads import (BATCH_SIZES, OUTPUT_NAMES, SEQ_LEN, make_inputs,
                                   within_tolerance)

from .helpers import bound, reference_grads, relative_errors

pytestmark = pytest.mark.gpu


def _float32_reference(inputs, num_heads=16, ln_grad="contract"):
    with torch.no_grad():
        return reference_grads(inputs, num_heads, ln_grad, dtype=torch.float32,
                               device="cuda")


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_contract_workload_within_tolerance(batch):
    for seed in range(2):                     # fresh inputs, as the benchmark draws them
        gen = torch.Generator(device="cuda").manual_seed(seed)
        inputs = make_inputs(batch, device="cuda", generator=gen)
        outputs = contract.run(*inputs.values())
        for name, out, ref in zip(OUTPUT_NAMES, outputs, _float32_reference(inputs)):
            ok, matched = within_tolerance(out, ref)
            assert ok, (batch, name, matched)


@pytest.mark.parametrize("batch", [1, 23, 56])
def test_float64_spot_check(batch):
    inputs = make_inputs(batch, device="cuda")
    outputs = contract.run(*inputs.values())
    refs = reference_grads(inputs, 16, "contract", device="cuda")
    for name, err in zip(OUTPUT_NAMES, relative_errors(outputs, refs)):
        # grad_qkv_weight is one fp16 product by design (~3e-4); the rest are bf16x3
        assert err < bound(name, "cuda"), (batch, name, err)


@pytest.mark.parametrize("batch", [2, 32])
def test_exact_mode(batch):
    inputs = make_inputs(batch, device="cuda")
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=16, ln_grad="exact")
    refs = reference_grads(inputs, 16, "exact", device="cuda")
    for name, err in zip(OUTPUT_NAMES, relative_errors(grads, refs)):
        assert err < bound(name, "cuda"), (name, err)


@pytest.mark.parametrize("seq_len,num_heads,head_dim", [
    (257, 16, 64), (1025, 16, 64), (577, 12, 64), (577, 16, 32), (577, 8, 128),
    (100, 4, 48)])                            # 48: no Triton kernel, PyTorch math instead
def test_odd_shapes(seq_len, num_heads, head_dim, monkeypatch):
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # skip GEMM autotuning
    inputs = make_inputs(2, seq_len=seq_len, embed_dim=num_heads * head_dim,
                         num_heads=num_heads, device="cuda")
    grads = vitattn_bwd.attention_block_backward(**inputs, num_heads=num_heads)
    refs = reference_grads(inputs, num_heads, "exact", device="cuda")
    for name, err in zip(OUTPUT_NAMES, relative_errors(grads, refs)):
        assert err < bound(name, "cuda"), (seq_len, name, err)


@pytest.mark.parametrize("batch", [1, 7])
def test_deterministic_and_outputs_survive_the_next_call(batch):
    inputs = make_inputs(batch, device="cuda")
    first = contract.run(*inputs.values())
    kept = [g.clone() for g in first]
    second = contract.run(*inputs.values())
    for name, a, b, c in zip(OUTPUT_NAMES, first, second, kept):
        assert torch.equal(a, b), name
        assert torch.equal(a, c), name     # the second call did not overwrite the first


@pytest.mark.parametrize("seq_len,head_dim", [(577, 64), (100, 32), (64, 128)])
def test_eager_triton_kernels(seq_len, head_dim):
    B, H = 2, 4
    inputs = make_inputs(B, seq_len=seq_len, embed_dim=H * head_dim, num_heads=H,
                         device="cuda")
    P, q, k, v = (inputs[n] for n in ("attn_weights", "q", "k", "v"))
    grad_attn = torch.randn(B, seq_len, H * head_dim, device="cuda")
    got = softmax_bwd.attention_backward(grad_attn, q, k, v, 0.125, probs=P)
    want = reference.softmax_attention_backward(
        P.double(), reference.split_heads(grad_attn.double(), H), q.double(), k.double(),
        v.double(), 0.125)
    for g, w in zip(got, want):            # bf16x3 products: ~1e-5
        assert relative_errors([g], [reference.merge_heads(w)])[0] < 5e-5


def test_no_process_wide_setting_changes_under_a_concurrent_user():
    """A user's float32 matmul on another thread stays float32 while our backward runs
    (it used to flip allow_tf32 for the whole process)."""
    inputs = make_inputs(23, device="cuda")
    contract.run(*inputs.values())                                  # compiled already
    a, b = torch.randn(2048, 2048, device="cuda"), torch.randn(2048, 2048, device="cuda")
    exact = (a.double() @ b.double())
    seen, errors, done = set(), [], threading.Event()

    def user():
        while not done.is_set():
            seen.add(torch.backends.cuda.matmul.allow_tf32)
            errors.append(relative_errors([a @ b], [exact])[0])

    thread = threading.Thread(target=user)
    thread.start()
    for _ in range(20):
        contract.run(*inputs.values())
    done.set()
    thread.join()
    assert seen == {False} and errors and max(errors) < 1e-5     # TF32 would be ~3e-4


def test_soak_1000_calls_memory_flat_no_recompiles_bitwise_equal():
    """1000 calls cycling through the 16 contract sizes, inputs at fresh addresses every
    call: memory flat and no compiles after the first cycle (whatever earlier tests of
    the process compiled), results bitwise equal to the first cycle's; then an absurd
    batch fails with a clear out-of-memory error and the next normal call still works."""
    pools = {B: make_inputs(B, device="cuda", generator=torch.Generator("cuda").manual_seed(B))
             for B in BATCH_SIZES}
    first, memory = {}, []
    for call in range(1000):
        if call == len(BATCH_SIZES):        # every size has run once: nothing more compiles
            compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        B = BATCH_SIZES[call % len(BATCH_SIZES)]
        fresh = {k: t.clone() if torch.is_tensor(t) else t for k, t in pools[B].items()}
        grads = contract.run(*fresh.values())
        if call < len(BATCH_SIZES):
            first[B] = [g.clone() for g in grads]
        elif call % 97 == 0:
            assert all(torch.equal(g, f) for g, f in zip(grads, first[B])), (call, B)
        if call % len(BATCH_SIZES) == len(BATCH_SIZES) - 1:
            del grads, fresh
            memory.append(torch.cuda.memory_allocated())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
    assert max(memory[1:]) == min(memory[1:]), memory
    # batch 4,000 (x 16 heads: inside the kernels' grid): its inputs, copied contiguous,
    # are 151 GB
    huge = make_inputs(1, device="cuda")
    huge = {k: (t.expand(4000, *t.shape[1:]) if torch.is_tensor(t) and t.shape[0] == 1
                and t.dim() > 1 and k not in ("qkv_weight", "out_weight") else t)
            for k, t in huge.items()}
    with pytest.raises(torch.OutOfMemoryError):
        contract.run(*huge.values())
    grads = contract.run(*pools[7].values())
    assert all(torch.equal(g, f) for g, f in zip(grads, first[7]))


@pytest.mark.parametrize("batch", [1, 2])    # batch 1: the static graph
def test_module_gradients_at_577_tokens(batch):
    torch.manual_seed(0)
    block = VisionAttentionBlock().cuda()
    x = torch.randn(batch, SEQ_LEN, 1024, device="cuda", requires_grad=True)
    y = block(x)
    grad_y = torch.randn_like(y)
    ours = torch.autograd.grad(y, [x, *block.parameters()], grad_y)
    params64 = [p.detach().double().requires_grad_() for p in block.parameters()]
    x64 = x.detach().double().requires_grad_()
    y64 = reference.block_forward(x64, *params64, num_heads=16, eps=1e-5)
    want = torch.autograd.grad(y64, [x64, *params64], grad_y.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-4)
    names = ["x"] + [name for name, _ in block.named_parameters()]
    for name, got, ref in zip(names, ours, want):
        # qkv.weight's gradient is the one fp16 product (~3e-4); the rest are bf16x3
        limit = 1e-3 if name == "qkv.weight" else 1e-4
        assert relative_errors([got], [ref])[0] < limit, name
