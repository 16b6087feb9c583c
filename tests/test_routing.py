"""routing.route, the pure function behind vision_attention's choice of computation,
over the settings it decides between: device, dtypes, autocast, the explicit precision
and torch's, torch.compile tracing, and where the one-product path runs."""
import itertools

import pytest
import torch

from vitattn_bwd import routing
from vitattn_bwd.precision import fused_products
from vitattn_bwd.routing import STOCK, STOCK_DETERMINISTIC_ATTENTION, Route

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def _route(dtypes=(F32,), x_dtype=None, autocast=None, precision=None,
           torch_precision="highest", compiling=False, one_product=(BF16, F16),
           device="cpu", fused_kernels=True, deterministic=False, backward_batch=None,
           deterministic_attention=(BF16, F16), torch_func=False):
    """routing.route with defaults: a float32 block on the CPU, no autocast, precision
    None, torch at "highest", eager, the one-product path in both half dtypes, without
    the deterministic flag or a backward to compute (deterministic_sdpa's operators in
    both half dtypes), outside torch.func transforms."""
    return routing.route(device_type=device, dtypes=set(dtypes),
                         x_dtype=x_dtype or dtypes[0], autocast_dtype=autocast,
                         precision=precision, float32_precision=torch_precision,
                         compiling=compiling, one_product=lambda dtype: dtype in one_product,
                         fused_kernels=fused_kernels, deterministic=deterministic,
                         backward_batch=backward_batch,
                         deterministic_attention=lambda dtype: dtype in deterministic_attention,
                         torch_func=torch_func)


def _fused(precision, half_dtype=None, compute=F32, opaque_ops=False):
    return Route(stock=False, products=fused_products(precision, half_dtype),
                 compute_dtype=compute, opaque_ops=opaque_ops)


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("autocast", [BF16, F16])
@pytest.mark.parametrize("dtypes,x_dtype", [((F32,), F32), ((F32, BF16), BF16),
                                            ((F32, BF16), F32), ((BF16,), BF16)])
def test_autocast_at_precision_none_runs_the_stock_ops(compiling, autocast, dtypes,
                                                       x_dtype):
    """Measured no faster there, eager (0.76-1.06x) and compiled (0.57-0.85x), for any
    dtypes and wherever the one-product path would run."""
    assert _route(dtypes, x_dtype, autocast=autocast, compiling=compiling) == STOCK


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_a_block_all_in_one_half_dtype_at_precision_none_runs_the_stock_ops(compiling,
                                                                            dtype):
    assert _route((dtype,), compiling=compiling) == STOCK
    assert _route((dtype,), torch_precision="medium", compiling=compiling) == STOCK


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("torch_precision,want", [
    ("highest", _fused("highest")), ("high", _fused("high")),
    ("medium", _fused("high", BF16))])
def test_float32_at_precision_none_follows_torch(compiling, torch_precision, want):
    """The fused path (1.24-1.45x stock in float32), at torch's float32 matmul
    precision; inside torch.compile as the opaque operators."""
    got = _route(torch_precision=torch_precision, compiling=compiling)
    assert got == want._replace(opaque_ops=compiling)


def test_an_explicit_precision_ignores_torch_and_autocast():
    for precision, autocast in itertools.product(("highest", "high"), (None, BF16)):
        assert _route(precision=precision, torch_precision=None,
                      autocast=autocast) == _fused(precision), (precision, autocast)
    # a half-precision block with an explicit float32-grade precision: cast to float32
    assert _route((BF16,), precision="high") == _fused("high")
    assert _route((F16, F32), F16, precision="highest", autocast=BF16) == _fused("highest")


@pytest.mark.parametrize("autocast,want", [(None, BF16), (BF16, BF16), (F16, F16)])
def test_medium_on_float32_is_the_one_product_path(autocast, want):
    """bf16 outside autocast, the autocast dtype inside it; "high" where the path does
    not run in that dtype."""
    assert _route(precision="medium", autocast=autocast) == _fused("high", want)
    assert _route(precision="medium", autocast=autocast,
                  one_product=()) == _fused("high")
    other = {BF16: F16, F16: BF16}[want]
    assert _route(precision="medium", autocast=autocast,
                  one_product=(other,)) == _fused("high")


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("autocast", [None, BF16, F16])
def test_medium_on_a_half_precision_block_runs_natively_in_its_dtype(dtype, autocast):
    assert _route((dtype,), precision="medium", autocast=autocast) == \
        _fused("high", dtype, compute=dtype)
    # where its dtype's path does not run: one product per matmul on float32 copies in
    # the dtype that "medium" takes for float32 tensors (the autocast dtype, else
    # bf16), where that one runs; else float32 math ("high")
    other = {BF16: F16, F16: BF16}[dtype]
    target = autocast or BF16
    assert _route((dtype,), precision="medium", autocast=autocast,
                  one_product=(other,)) == _fused("high", target if target == other
                                                   else None)


def test_medium_on_mixed_dtypes_casts_to_float32():
    assert _route((F32, BF16), BF16, precision="medium") == _fused("high", BF16)
    assert _route((F32, F16), F32, precision="medium", autocast=F16) == _fused("high", F16)


def test_float64_on_the_cpu_is_float64_math():
    assert _route((F64,)) == _fused("highest", compute=F64)
    assert _route((F64,), torch_precision="high") == _fused("high", compute=F64)
    assert _route((F64, F32), F32, precision="high") == _fused("high", compute=F64)
    # no one-product path on float64 tensors: "medium" is float64 math
    assert _route((F64,), precision="medium") == _fused("high", compute=F64)
    # inside autocast (an explicit precision): float32, as custom kernels cast
    assert _route((F64,), precision="high", autocast=BF16) == _fused("high")
    assert _route((F64,), autocast=BF16) == STOCK


@pytest.mark.parametrize("facts", [
    dict(), dict(precision="highest"), dict(precision="medium", autocast=BF16),
    dict(dtypes=(BF16,), deterministic=True), dict(autocast=BF16, backward_batch=64),
    dict(dtypes=(F64,), device="cuda", precision="high")])
def test_torch_func_transforms_take_the_stock_ops(facts):
    """Under torch.func.grad / vmap: the stock ops at any precision and setting (our
    Function and operators have no functorch rules), float64 on CUDA included."""
    assert _route(**facts, torch_func=True) == STOCK


def test_float64_elsewhere_is_refused():
    with pytest.raises(TypeError, match="float64 is not supported on cuda"):
        _route((F64,), device="cuda")
    with pytest.raises(TypeError, match="float64 is not supported on cuda"):
        _route((F64, F32), F32, precision="medium", device="cuda")
    assert _route((F64,), device="cuda", autocast=BF16) == STOCK


def test_compiling_selects_the_opaque_operators_on_the_fused_path_only():
    for kwargs in (dict(), dict(precision="medium"), dict(precision="high", autocast=BF16),
                   dict(dtypes=(BF16,), precision="medium")):
        eager, traced = _route(**kwargs), _route(**kwargs, compiling=True)
        assert not eager.opaque_ops and traced == eager._replace(opaque_ops=True), kwargs
    assert _route(autocast=BF16, compiling=True) == STOCK


def test_the_one_product_facts_asked_are_the_dtypes_it_would_run_in():
    asked = []

    def one_product(dtype):
        asked.append(dtype)
        return True
    routing.route(device_type="cuda", dtypes={F32}, x_dtype=F32, autocast_dtype=None,
                  precision=None, float32_precision="high", compiling=False,
                  one_product=one_product)
    assert asked == []                         # the fused float32 path needs none
    routing.route(device_type="cuda", dtypes={F32}, x_dtype=F32, autocast_dtype=F16,
                  precision="medium", float32_precision=None, compiling=False,
                  one_product=one_product)
    assert asked == [F16]


def test_one_product_supported_is_the_cpu_or_gluon():
    assert routing.one_product_supported(torch.device("cpu"), BF16, 72)
    # no CUDA device here: softmax_bwd_gluon.available says no before asking the device
    assert not routing.one_product_supported(torch.device("meta"), BF16, 64)


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("torch_precision", ["highest", "high"])
def test_a_head_dim_without_kernels_runs_the_stock_ops_unless_asked(compiling,
                                                                    torch_precision):
    """Float32 on a GPU at a head dim the attention core has no kernels for (one that
    is not a multiple of 8, or above 128): the stock ops at precision None; an explicit
    precision still runs the fused path."""
    assert _route(torch_precision=torch_precision, compiling=compiling, device="cuda",
                  fused_kernels=False) == STOCK
    assert _route(precision="high", compiling=compiling, device="cuda",
                  fused_kernels=False) == _fused("high", opaque_ops=compiling)


def test_fused_kernels_are_the_templates_head_dims_on_cuda():
    """Every multiple of 8 up to 128 (SigLIP so400m's 72, OpenCLIP ViT-H's 80, bigG's
    104 included), nothing else; the CPU's math takes any."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [d for d in range(1, 257) if routing.fused_kernels_for(cuda, d)] == \
        list(range(8, 129, 8))
    assert routing.fused_kernels_for(cpu, 72) and routing.fused_kernels_for(cpu, 12)


@pytest.mark.parametrize("compiling", [False, True])
def test_float32_at_a_padded_head_dim_runs_the_fused_path(compiling):
    """Head dim 72 on a GPU now has kernels: precision None in float32 runs the fused
    path at torch's precision, as at 64."""
    fused_kernels = routing.fused_kernels_for(torch.device("cuda"), 72)
    assert _route(torch_precision="high", compiling=compiling, device="cuda",
                  fused_kernels=fused_kernels) == _fused("high", opaque_ops=compiling)


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("dtypes,x_dtype,autocast,half", [
    ((F32,), F32, BF16, BF16), ((F32,), F32, F16, F16), ((BF16,), BF16, None, BF16),
    ((F16,), F16, None, F16), ((F16,), F16, BF16, BF16)])
def test_the_deterministic_flag_gives_the_stock_route_our_deterministic_attention(
        compiling, dtypes, x_dtype, autocast, half):
    """Under torch.use_deterministic_algorithms(True), where the stock ops run in a half
    dtype (autocast's, else a half-precision block's) and deterministic_sdpa runs in it;
    the stock ops' own SDPA otherwise."""
    facts = dict(dtypes=dtypes, x_dtype=x_dtype, autocast=autocast, compiling=compiling)
    assert _route(**facts, deterministic=True) == STOCK_DETERMINISTIC_ATTENTION
    assert _route(**facts) == STOCK
    other = {BF16: F16, F16: BF16}[half]
    assert _route(**facts, deterministic=True, deterministic_attention=(other,)) == STOCK


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("dtypes,x_dtype,autocast", [
    ((F32,), F32, BF16), ((F32, BF16), BF16, BF16), ((BF16,), BF16, None),
    ((F16,), F16, BF16)])
def test_bf16_training_steps_take_our_attention_from_a_batch_size(compiling, dtypes,
                                                                  x_dtype, autocast):
    """Without the flag, where the stock ops run in bf16 with a backward to compute, our
    attention from routing.OUR_ATTENTION_MIN_BATCH images on (where deterministic_sdpa
    runs); SDPA below it, without a backward, where the operators do not run, and in
    fp16 (not measured)."""
    facts = dict(dtypes=dtypes, x_dtype=x_dtype, autocast=autocast, compiling=compiling)
    smallest = routing.OUR_ATTENTION_MIN_BATCH
    assert _route(**facts, backward_batch=smallest) == STOCK_DETERMINISTIC_ATTENTION
    assert _route(**facts, backward_batch=smallest + 31) == STOCK_DETERMINISTIC_ATTENTION
    assert _route(**facts, backward_batch=smallest - 1) == STOCK
    assert _route(**facts) == STOCK
    assert _route(**facts, backward_batch=smallest, deterministic_attention=(F16,)) == STOCK
    fp16 = dict(facts, dtypes=(F16,), x_dtype=F16, autocast=None)
    assert _route(**fp16, backward_batch=smallest) == STOCK
    assert _route(**dict(facts, autocast=F16), backward_batch=smallest) == STOCK


def test_our_attention_leaves_float64_and_the_fused_paths_alone():
    assert _route((F64, F32), autocast=BF16, backward_batch=64) == STOCK
    assert _route(backward_batch=64) == _fused("highest")
    assert _route(precision="medium", autocast=BF16, backward_batch=64) == _fused(
        "high", BF16)


@pytest.mark.parametrize("dtypes", [(F64,), (F64, F32)])
def test_the_deterministic_flag_leaves_float64_under_autocast_to_sdpa(dtypes):
    """Autocast leaves float64 alone, so SDPA's inputs stay float64: not the half-dtype
    operators."""
    assert _route(dtypes, autocast=BF16, device="cuda", deterministic=True) == STOCK


def test_the_deterministic_flag_leaves_the_fused_paths_and_float32_stock_alone():
    """The fused paths are deterministic by construction; a float32 block at a head dim
    without kernels runs float32 SDPA, which the flag does not take off cuDNN."""
    assert _route(deterministic=True) == _fused("highest")
    assert _route(precision="medium", autocast=BF16, deterministic=True) == _fused(
        "high", BF16)
    assert _route((BF16,), precision="high", deterministic=True) == _fused("high")
    assert _route(device="cuda", fused_kernels=False, deterministic=True) == STOCK


def test_small_float32_training_steps_inside_torch_compile_at_high_run_the_stock_ops():
    """Inside torch.compile on a GPU at torch's "high", training steps of at most
    routing.COMPILED_FLOAT32_STOCK_MAX_BATCH images take the stock ops (our operators
    left that tower host-bound); everything else about the call keeps the fused path:
    a larger batch, eager calls, no backward, "highest", the deterministic flag, an
    explicit precision, the CPU, other dtypes."""
    largest = routing.COMPILED_FLOAT32_STOCK_MAX_BATCH
    facts = dict(device="cuda", torch_precision="high", compiling=True)
    for batch in range(1, largest + 1):
        assert _route(**facts, backward_batch=batch) == STOCK, batch
    assert _route(**facts, backward_batch=largest + 1) == _fused("high", opaque_ops=True)
    assert _route(**dict(facts, compiling=False), backward_batch=1) == _fused("high")
    assert _route(**facts) == _fused("high", opaque_ops=True)
    assert _route(**dict(facts, torch_precision="highest"), backward_batch=1) == _fused(
        "highest", opaque_ops=True)
    assert _route(**facts, deterministic=True, backward_batch=1) == _fused(
        "high", opaque_ops=True)
    assert _route(**facts, precision="high", backward_batch=1) == _fused(
        "high", opaque_ops=True)
    assert _route(**dict(facts, device="cpu"), backward_batch=1) == _fused(
        "high", opaque_ops=True)
    assert _route((F32, BF16), F32, **facts, backward_batch=1) == _fused(
        "high", opaque_ops=True)
    with pytest.raises(TypeError, match="float64"):
        _route((F64,), **facts, backward_batch=1)


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_small_batch_rule_under_torch_compile_leaves_a_dynamic_batch_alone(dynamic):
    """Traced by torch.compile with the batch from a tensor's shape: a static batch of 2
    takes the stock ops; a batch marked dynamic keeps our operators, with no guard that
    would pin it to 2 (which raises for a batch the caller marked dynamic)."""
    def stock_or_fused(x):
        decision = routing.route(
            device_type="cuda", dtypes={F32}, x_dtype=F32, autocast_dtype=None,
            precision=None, float32_precision="high", compiling=True,
            one_product=lambda dtype: False, backward_batch=x.shape[0])
        return x + (1.0 if decision.stock else 2.0)
    x = torch.zeros(routing.COMPILED_FLOAT32_STOCK_MAX_BATCH, 3)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    got = torch.compile(stock_or_fused, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, torch.full_like(x, 2.0 if dynamic else 1.0))
