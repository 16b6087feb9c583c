"""CPU property tests, drawn from the strategies the GPU properties use (tests/strategies.py)
at small sizes:

- the raw Triton kernels of the attention core (softmax_bwd.attention_backward) under
  Triton's interpreter, against float64, over seq_len 1-80 with the tile edges, heads,
  head dims 16-128, scale, tile sizes, and inputs that are views at odd offsets,
  transposed, strided or padded; with P given, and in module mode (the log-sum-exp given,
  P recomputed from q and k);
- the fused attention forward's kernel (attention_fwd.launch_attention_fwd) under the
  interpreter, against float64 softmax attention, over the same shapes, scales, tiles and
  layouts;
- the compiled CPU path (vitattn_bwd.attention_block_backward) against float64 over
  shapes, batch buckets, both LayerNorm modes, float32/float64 and the same layouts;
- VisionAttentionBlock's forward and backward on the CPU against float64 autograd through
  the stock block, over small configurations, eps, logit sizes, float32/float64 and
  layouts of x and of the output gradient;
- each property once more with every planted error that applies (tests/plants.py), each
  run expected to fail.
"""
import dataclasses
import math
import os

import pytest
import torch
from hypothesis import strategies as st

from vitattn_bwd import softmax_bwd

from . import plants
from . import strategies as S


@pytest.fixture
def triton_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: tests/test_gpu_properties.py runs the kernels there")
    from .triton_interpreter import patch_bf16_dot
    patch_bf16_dot()          # bf16 dots are wrong in the interpreter without it


# --- the attention core under the Triton interpreter ----------------------------------

# the interpreter is slow: S <= 80, B*H <= 4
INTERPRETER_CORE = S.core_cases(max_seq=80, max_heads=2, max_batch=2, max_batch_heads=4,
                                tiles=(None, 16, 32, 64))
CORE_EXAMPLE = S.CoreCase(batch=2, heads=2, seq_len=33, head_dim=16, scale=0.25, seed=1,
                          p_source="random",
                          layouts=("offset", "transposed", "strided", "padded", "transposed"),
                          offset=3, block_m=16, block_n=32)


def _attention_backward(*args, **kwargs):       # looked up per call: plants replace it
    return softmax_bwd.attention_backward(*args, **kwargs)


def _check_core(case):
    with plants.planted(plants.from_env()):
        return S.check_core(case, "cpu", S.CORE_BOUNDS_INTERPRETER, _attention_backward)


def test_softmax_bwd_kernels_under_interpreter(triton_interpreter):
    S.run_property("interpreter: attention core", _check_core, INTERPRETER_CORE,
                   explicit=[CORE_EXAMPLE], max_examples=S.profile_examples(15))


@pytest.mark.parametrize("plant", plants.plants_for("core"))
def test_softmax_bwd_property_catches(triton_interpreter, plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"interpreter: attention core + {plant}", _check_core,
                       INTERPRETER_CORE, explicit=[CORE_EXAMPLE], **S.PLANT_SETTINGS)


# Module mode: the core gets lse [B,H,S] and recomputes P (bounds: CORE_BOUNDS_INTERPRETER
# + LOGIT_SLOPE * Lambda, dQ and dK measured against the terms that cancel into them;
# tests/strategies.py). Lambda here reaches 23 (scale 2, head_dim 128).
INTERPRETER_CORE_LSE = S.core_cases(max_seq=80, max_heads=2, max_batch=2,
                                    max_batch_heads=4, tiles=(None, 16, 32, 64),
                                    p_sources=("lse",))
CORE_LSE_EXAMPLE = dataclasses.replace(CORE_EXAMPLE, p_source="lse", seed=2, scale=0.5)


def test_softmax_bwd_module_mode_under_interpreter(triton_interpreter):
    S.run_property("interpreter: attention core, module mode (lse)", _check_core,
                   INTERPRETER_CORE_LSE, explicit=[CORE_LSE_EXAMPLE],
                   max_examples=S.profile_examples(10))


@pytest.mark.parametrize("plant", plants.plants_for("core"))
def test_softmax_bwd_module_mode_property_catches(triton_interpreter, plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"interpreter: attention core, module mode + {plant}", _check_core,
                       INTERPRETER_CORE_LSE, explicit=[CORE_LSE_EXAMPLE],
                       **S.PLANT_SETTINGS)


# --- the attention forward kernel under the interpreter -------------------------------

# bound: FWD_BOUND_INTERPRETER + LOGIT_SLOPE * Lambda (tests/strategies.py)
INTERPRETER_FWD = S.fwd_cases(max_seq=80, max_heads=2, max_batch=2, max_batch_heads=4,
                              tiles=(None, (16, 16), (32, 16), (16, 32)))
FWD_EXAMPLE = S.FwdCase(batch=2, heads=2, seq_len=33, head_dim=16, scale=0.25, seed=1,
                        layouts=("offset", "transposed", "padded"), offset=3,
                        tiles=(16, 32))


def _check_fwd(case):
    with plants.planted(plants.from_env()):
        return S.check_fwd(case, "cpu", S.FWD_BOUND_INTERPRETER, S.public_attention_fwd)


def test_attention_fwd_kernel_under_interpreter(triton_interpreter):
    S.run_property("interpreter: attention forward", _check_fwd, INTERPRETER_FWD,
                   explicit=[FWD_EXAMPLE], max_examples=S.profile_examples(10))


@pytest.mark.parametrize("plant", plants.plants_for("fwd"))
def test_attention_fwd_property_catches(triton_interpreter, plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"interpreter: attention forward + {plant}", _check_fwd,
                       INTERPRETER_FWD, explicit=[FWD_EXAMPLE], **S.PLANT_SETTINGS)


def test_interpreter_core_bounds_separate_bf16x3_from_one_bf16_product(triton_interpreter):
    """The bounds are tight enough to matter: one plain bf16 product per matmul (what a
    dropped lo term gives) lands above every bound."""
    case = CORE_EXAMPLE
    logical, _ = S.core_inputs(case, "cpu")
    want = S.core_reference(*(logical[n] for n in S.CORE_TENSORS), case.scale)
    bf16 = S.core_reference(*(plants.round_bf16(logical[n]) for n in S.CORE_TENSORS),
                            case.scale)
    probs = S.core_probabilities(logical, case.scale)
    errors = S.core_errors([b.float() for b in bf16], want, case.seq_len,
                           S.cancelled_terms(probs, logical, case.scale))
    for name, err in errors.items():
        assert err > S.CORE_BOUNDS_INTERPRETER[name], (name, err)


# --- the compiled CPU path -----------------------------------------------------------

# each new (shape, scale, eps, mode, dtype, batch bucket) is a compile of a few seconds:
# under the ci profile the explicit case and 3 drawn ones (the thorough profile: 30)
COMPILED_CPU = S.block_cases(seqs=S.seq_lens(24), max_heads=2, head_dims=(8, 16),
                             max_batch=4, dtypes=(torch.float32, torch.float64),
                             batches=st.one_of(st.integers(1, 4), st.sampled_from([16, 17])))
BLOCK_EXAMPLE = S.BlockCase(batch=2, seq_len=17, heads=2, head_dim=8, ln_grad="contract",
                            seed=3, scale=1 / math.sqrt(8), norm_eps=1e-5,
                            layouts=S.MIXED_BLOCK_LAYOUTS, offset=3)


def _check_compiled_cpu(case):
    bounds = {name: S.BLOCK_BOUNDS_CPU[case.dtype] for name in S.BLOCK_BOUNDS_GPU}
    with plants.planted(plants.from_env()):
        return S.check_block(case, "cpu", bounds, S.public_block_backward)


def test_compiled_cpu_path_matches_float64():
    S.run_property("compiled CPU path", _check_compiled_cpu, COMPILED_CPU,
                   explicit=[BLOCK_EXAMPLE], max_examples=S.profile_examples(3, 30))


# the other block plants (settings, recompiles) are invariants of tests/test_stateful.py
BLOCK_PLANTS = ("drop_lo", "round_out", "drop_last_token", "exact_ln", "mutate_input")


@pytest.mark.parametrize("plant", BLOCK_PLANTS)
def test_compiled_cpu_property_catches(plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"compiled CPU path + {plant}", _check_compiled_cpu, COMPILED_CPU,
                       explicit=[BLOCK_EXAMPLE], **S.PLANT_SETTINGS)


# --- VisionAttentionBlock on the CPU ----------------------------------------------------

# bounds: BLOCK_BOUNDS_CPU by dtype (plain float32 / float64 math, forward and backward).
# Each new (shape, eps, dtype, batch bucket) compiles the backward (~3 s): few examples
# (ci: the explicit case and 2 drawn; thorough: 20).
MODULE_CPU = S.module_cases(seqs=S.seq_lens(24), max_heads=2, head_dims=(8, 16),
                            batches=st.integers(1, 3),
                            dtypes=(torch.float32, torch.float64))
MODULE_EXAMPLE = S.ModuleCase(batch=2, seq_len=17, heads=2, head_dim=8, eps=1e-5, seed=4,
                              qkv_gain=2.0, layouts=("offset", "transposed"), offset=3)


def _check_module_cpu(case):
    with plants.planted(plants.from_env()):
        return S.check_module(case, "cpu", S.module_bounds_cpu(case.dtype))


def test_module_cpu_matches_float64():
    S.run_property("module on the CPU", _check_module_cpu, MODULE_CPU,
                   explicit=[MODULE_EXAMPLE], max_examples=S.profile_examples(2, 20))


# each plant at the module's forward (the attention operator it calls) and at its backward
@pytest.mark.parametrize("plant,target", plants.plant_targets("module_fwd", "module_bwd"))
def test_module_cpu_property_catches(plant, target):
    with plants.planted(plant, only=target), pytest.raises(AssertionError):
        S.run_property(f"module on the CPU + {plant} ({target})", _check_module_cpu,
                       MODULE_CPU, explicit=[MODULE_EXAMPLE], **S.PLANT_SETTINGS)
