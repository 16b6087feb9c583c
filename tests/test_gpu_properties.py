"""GPU hypothesis properties (H200), bounded in examples and in time: about 4.5 minutes for
the whole file, compiles included (about 3 for the first three below, about 1.5 for the
forward, module-mode core and module properties). Run with the gpu profile:

    HYPOTHESIS_PROFILE=gpu PYTHONPATH=. python3 -m pytest -q -m gpu tests/test_gpu_properties.py

- the eager launchers of the attention core (softmax_bwd.attention_backward) against
  float64 over seq_len 1-1100 with the tile edges, heads 1-16, head_dim 16-128, batch
  1-8, scale, tile overrides, and inputs that are views at odd offsets, transposed,
  strided or padded (tests/strategies.py; bounds from the precision map there);
- the compiled path (vitattn_bwd.attention_block_backward) over a smaller draw, in the
  default compile mode (compile time bounded);
- the contract's margin over drawn seeds at batch 56 (577 tokens, 1024 wide, 16 heads):
  every output of contract.run against the float64 reference on the GPU, at most 3 misses
  of |out - ref| <= 1e-2 + 1e-2 |ref| per 1,024-element vector, matched >= 0.999
  elsewhere;
- the same margins over batch sizes 57-1,850 (420 and 1,850 always, one drawn; about 2
  minutes with the recompiles; the float64 reference in chunks of the batch,
  scripts/harness.py);
- the fused attention forward (the operator vitattn_bwd::attention_fwd with its default
  tiles, the launcher with tile overrides) against float64 softmax attention (attn_output,
  lse, P recomputed from lse) over the core's draw of shapes, scales and layouts
  (25 examples or 20 s);
- the attention core in module mode (the log-sum-exp given, P recomputed from q and k)
  over the same draw (25 examples or 20 s);
- VisionAttentionBlock's forward and backward against float64 autograd through the stock
  block over small configurations (embed 32-512, 1-8 heads, seq_len 1-300, batch 1-8,
  eps, logit sizes, layouts of x and of the output gradient), default compile mode, TF32
  off (the explicit example and one drawn: ~40 s);
- each property again with planted errors (tests/plants.py), each expected to fail.
The terminal summary lists examples, seconds and the largest errors per property.
"""
import pytest
import torch
from hypothesis import strategies as st

from vitattn_bwd import contract, softmax_bwd
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs

from . import plants
from . import strategies as S
from .helpers import reference_grads

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

# --- the eager attention core --------------------------------------------------------

GPU_CORE = S.core_cases(max_seq=1100, max_heads=16, max_batch=8,
                        tiles=(None, None, None, 16, 32))     # mostly the default tiles
CORE_EXAMPLES = [
    S.CoreCase(batch=2, heads=3, seq_len=129, head_dim=64, scale=0.125, seed=5,
               p_source="qk", layouts=("transposed", "offset", "transposed", "strided",
                                       "padded"), offset=3),
    S.CoreCase(batch=1, heads=16, seq_len=577, head_dim=128, scale=0.088, seed=6,
               p_source="random", layouts=("offset", "padded", "transposed", "transposed",
                                           "offset"), offset=1),
    S.CoreCase(batch=8, heads=1, seq_len=1, head_dim=16, scale=1.3, seed=7,
               p_source="random", layouts=("contiguous",) * 5, offset=1,
               block_m=16, block_n=32),
]


def _attention_backward(*args, **kwargs):       # looked up per call: plants replace it
    return softmax_bwd.attention_backward(*args, **kwargs)


def _check_core(case):
    with plants.planted(plants.from_env()):
        return S.check_core(case, DEVICE, S.CORE_BOUNDS_GPU, _attention_backward)


def test_softmax_bwd_matches_float64():
    S.run_property("gpu: attention core (eager)", _check_core, GPU_CORE,
                   explicit=CORE_EXAMPLES, max_examples=40, budget_s=60)


@pytest.mark.parametrize("plant", plants.plants_for("core"))
def test_softmax_bwd_property_catches(plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"gpu: attention core + {plant}", _check_core, GPU_CORE,
                       explicit=CORE_EXAMPLES[:1], **S.PLANT_SETTINGS_EXPLICIT)


# --- the compiled path, default compile mode ------------------------------------------

GPU_COMPILED = S.block_cases(seqs=S.seq_lens(300), max_heads=8, head_dims=(32, 64),
                             max_batch=8)
BLOCK_EXAMPLE = S.BlockCase(batch=3, seq_len=65, heads=4, head_dim=64, ln_grad="exact",
                            seed=11, scale=0.125, norm_eps=1e-5,
                            layouts=S.MIXED_BLOCK_LAYOUTS, offset=3)


def _check_compiled(case):
    with plants.planted(plants.from_env()):
        return S.check_block(case, DEVICE, S.BLOCK_BOUNDS_GPU, S.public_block_backward)


@pytest.fixture
def default_compile_mode(monkeypatch):
    monkeypatch.setenv("VITATTN_BWD_COMPILE_MODE", "default")    # no GEMM autotuning


def test_compiled_path_matches_float64(default_compile_mode):
    S.run_property("gpu: compiled path (default mode)", _check_compiled, GPU_COMPILED,
                   explicit=[BLOCK_EXAMPLE], max_examples=2, budget_s=50)


@pytest.mark.parametrize("plant", ["drop_lo", "round_out", "drop_last_token"])
def test_compiled_path_property_catches(default_compile_mode, plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"gpu: compiled path + {plant}", _check_compiled, GPU_COMPILED,
                       explicit=[BLOCK_EXAMPLE], **S.PLANT_SETTINGS_EXPLICIT)


# --- the contract's margin over seeds at batch 56 ----------------------------------------

VECTORS = ("grad_ln_weight", "grad_ln_bias", "grad_out_bias")     # 1,024 elements each
MAX_VECTOR_MISSES = 3
MIN_MATCHED = 0.999


def _contract_run(*args):
    return contract.run(*args)


def _check_contract_seed(seed):
    """contract.run at batch 56 (max-autotune, as the benchmark runs it) against the
    float64 reference computed on the GPU from the same float32 inputs."""
    with plants.planted(plants.from_env()):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        inputs = make_inputs(56, device=DEVICE, generator=gen)
        outputs = _contract_run(*inputs.values())
        torch.cuda.synchronize()
        with torch.no_grad():
            refs = reference_grads(inputs, 16, "contract", device=DEVICE)
        worst = {}
        for name, out, ref in zip(OUTPUT_NAMES, outputs, refs):
            assert torch.isfinite(out).all(), (seed, name)
            misses = ((out.double() - ref).abs() > 1e-2 + 1e-2 * ref.abs()).sum().item()
            if name in VECTORS:
                assert misses <= MAX_VECTOR_MISSES, (seed, name, misses)
            matched = 1.0 - misses / ref.numel()
            assert matched >= MIN_MATCHED, (seed, name, matched)
            worst[name] = 1.0 - matched          # reported as the "error": missed fraction
        del inputs, outputs, refs
        torch.cuda.empty_cache()
        return worst


def test_contract_margin_over_seeds():
    S.run_property("gpu: contract margin at batch 56 (missed fraction)", _check_contract_seed,
                   st.integers(0, 2 ** 31 - 1), explicit=[0], max_examples=4, budget_s=50)


@pytest.mark.parametrize("plant", ["exact_ln", "vector_misses", "matrix_misses",
                                   "drop_last_token"])
def test_contract_margin_property_catches(plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"gpu: contract margin + {plant}", _check_contract_seed,
                       st.integers(0, 2 ** 31 - 1), explicit=[0],
                       **S.PLANT_SETTINGS_EXPLICIT)


# batch sizes past the benchmark's: 420 (a margin of 0.996 seen there, issue 36) and
# 1,850 (about the largest whose inputs, 70 GB with P, and backward fit an H200; its
# grad_kv [B*S, 2E] passes 2^31 elements)
# 1850 needs ~125 GB of an H200's 139 GiB; a card with less memory takes a batch scaled
# to its memory (an H100's 79 GiB: ~1050; at 1850 the input draw ran out of memory there)
H200_MEMORY = 139 * 2**30


def _largest_batch():
    return min(1850, int(1850 * torch.cuda.get_device_properties(0).total_memory
                         / H200_MEMORY))


def _check_contract_batch(batch):
    """The entry point at `batch` against float64 (scripts/harness.py: the reference in
    chunks of the batch), the same margins as at batch 56."""
    from scripts.harness import contract_margins
    margins = contract_margins(batch, seed=batch)
    torch.cuda.empty_cache()
    for name, margin in margins.items():
        if name in VECTORS:
            assert margin["misses"] <= MAX_VECTOR_MISSES, (batch, name, margin)
        assert margin["matched"] >= MIN_MATCHED, (batch, name, margin)
    return {name: 1.0 - margin["matched"] for name, margin in margins.items()}


def test_contract_margin_over_batch_sizes():
    largest = _largest_batch()
    S.run_property("gpu: contract margin over batch sizes (missed fraction)",
                   _check_contract_batch, st.integers(57, largest),
                   explicit=[420, largest], max_examples=1, budget_s=90)


# --- the fused attention forward ----------------------------------------------------------

# bound: FWD_BOUND_GPU + LOGIT_SLOPE * Lambda (tests/strategies.py); tiles None: the
# operator as the module calls it, else the launcher with those tiles
GPU_FWD = S.fwd_cases(max_seq=1100, max_heads=16, max_batch=8,
                      tiles=(None, None, None, (32, 32), (16, 64)))
FWD_EXAMPLES = [
    # the module's layout (heads of one QKV output: sequence-major), ViT-L/14 size
    S.FwdCase(batch=2, heads=16, seq_len=577, head_dim=64, scale=0.125, seed=51,
              layouts=("transposed",) * 3, offset=1),
    S.FwdCase(batch=1, heads=3, seq_len=129, head_dim=128, scale=2.0, seed=52,
              layouts=("offset", "padded", "strided"), offset=3, tiles=(32, 32)),
    S.FwdCase(batch=8, heads=1, seq_len=1, head_dim=16, scale=1.3, seed=53,
              layouts=("contiguous",) * 3, offset=1),
    S.FwdCase(batch=3, heads=2, seq_len=1100, head_dim=32, scale=0.01, seed=54,
              layouts=("padded", "transposed", "offset"), offset=7, tiles=(16, 64)),
]


def _check_fwd(case):
    with plants.planted(plants.from_env()):
        return S.check_fwd(case, DEVICE, S.FWD_BOUND_GPU, S.public_attention_fwd)


def test_attention_fwd_matches_float64():
    S.run_property("gpu: attention forward", _check_fwd, GPU_FWD, explicit=FWD_EXAMPLES,
                   max_examples=25, budget_s=20)


@pytest.mark.parametrize("plant", plants.plants_for("fwd"))
def test_attention_fwd_property_catches(plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"gpu: attention forward + {plant}", _check_fwd, GPU_FWD,
                       explicit=FWD_EXAMPLES[:1], **S.PLANT_SETTINGS_EXPLICIT)


# --- the attention core in module mode (lse given, P recomputed) -----------------------

# bounds: CORE_BOUNDS_GPU + LOGIT_SLOPE * Lambda, dQ and dK against the larger of their
# norm and the terms that cancel into them (tests/strategies.py)
GPU_CORE_LSE = S.core_cases(max_seq=1100, max_heads=16, max_batch=8,
                            tiles=(None, None, None, 16, 32), p_sources=("lse",))
CORE_LSE_EXAMPLES = [
    S.CoreCase(batch=2, heads=16, seq_len=577, head_dim=64, scale=0.125, seed=41,
               p_source="lse", layouts=("offset", "transposed", "transposed",
                                        "transposed", "padded"), offset=3),
    S.CoreCase(batch=1, heads=2, seq_len=1025, head_dim=128, scale=2.0, seed=42,
               p_source="lse", layouts=("transposed", "padded", "offset", "strided",
                                        "contiguous"), offset=1, block_m=32, block_n=16),
    S.CoreCase(batch=8, heads=1, seq_len=1, head_dim=16, scale=1.3, seed=43,
               p_source="lse", layouts=("contiguous",) * 5, offset=1),
]


def test_softmax_bwd_module_mode_matches_float64():
    S.run_property("gpu: attention core, module mode (lse)", _check_core, GPU_CORE_LSE,
                   explicit=CORE_LSE_EXAMPLES, max_examples=25, budget_s=20)


@pytest.mark.parametrize("plant", plants.plants_for("core"))
def test_softmax_bwd_module_mode_property_catches(plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"gpu: attention core, module mode + {plant}", _check_core,
                       GPU_CORE_LSE, explicit=CORE_LSE_EXAMPLES[:1],
                       **S.PLANT_SETTINGS_EXPLICIT)


# --- VisionAttentionBlock, default compile mode ----------------------------------------

# bounds: S.module_bounds_gpu(Lambda): BLOCK_BOUNDS_GPU by gradient + FWD_BOUND_GPU +
# LOGIT_SLOPE * Lambda; y FWD_BOUND_GPU + LOGIT_SLOPE * Lambda. Each drawn example
# compiles a backward graph (~20 s in the default mode): the explicit one and one drawn.
GPU_MODULE = S.module_cases(seqs=S.seq_lens(300), max_heads=8, head_dims=(32, 64),
                            batches=st.integers(1, 8))
MODULE_EXAMPLE = S.ModuleCase(batch=3, seq_len=65, heads=4, head_dim=64, eps=1e-5, seed=61,
                              qkv_gain=1.0, layouts=("transposed", "offset"), offset=3)


def _check_module(case):
    with plants.planted(plants.from_env()):
        return S.check_module(case, DEVICE, S.module_bounds_gpu)


def test_module_matches_float64(default_compile_mode, no_tf32):
    S.run_property("gpu: VisionAttentionBlock (default mode)", _check_module, GPU_MODULE,
                   explicit=[MODULE_EXAMPLE], max_examples=1, budget_s=25)


# Batch 1, one token: q, k and v are views of one qkv buffer that the lowering does not
# copy (size-1 dimensions make them contiguous). Hypothesis's simplest draw; it found the
# lowering's split cache giving k and v the halves of q (session 7).
@pytest.mark.parametrize("heads,head_dim", [(1, 32), (2, 64)])
def test_module_single_token_at_batch_one(default_compile_mode, no_tf32, heads, head_dim):
    _check_module(S.ModuleCase(batch=1, seq_len=1, heads=heads, head_dim=head_dim,
                               eps=1e-5, seed=0, qkv_gain=0.5,
                               layouts=("contiguous", "contiguous"), offset=1,
                               dtype=torch.float32))


# each plant at the module's forward (the attention operator it calls) and its backward
@pytest.mark.parametrize("plant,target", plants.plant_targets("module_fwd", "module_bwd"))
def test_module_property_catches(default_compile_mode, no_tf32, plant, target):
    with plants.planted(plant, only=target), pytest.raises(AssertionError):
        S.run_property(f"gpu: VisionAttentionBlock + {plant} ({target})", _check_module,
                       GPU_MODULE, explicit=[MODULE_EXAMPLE], **S.PLANT_SETTINGS_EXPLICIT)
