"""CPU property tests, drawn from the strategies the GPU properties use (tests/strategies.py)
at small sizes:

- the raw Triton kernels of the attention core (attention_core.attention_backward) under
  Triton's interpreter, against float64, over seq_len 1-80 with the tile edges, heads,
  head dims 16-128, scale, tile sizes, and inputs that are views at odd offsets,
  transposed, strided or padded;
- the compiled CPU path (vitattn_bwd.attention_block_backward) against float64 over
  shapes, batch buckets, both LayerNorm modes, float32/float64 and the same layouts;
- each property once more with every planted error that applies (tests/plants.py), each
  run expected to fail.
"""
import math
import os

import pytest
import torch
from hypothesis import strategies as st

from vitattn_bwd import attention_core

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
    return attention_core.attention_backward(*args, **kwargs)


def _check_core(case):
    with plants.planted(plants.from_env()):
        return S.check_core(case, "cpu", S.CORE_BOUNDS_INTERPRETER, _attention_backward)


def test_attention_core_kernels_under_interpreter(triton_interpreter):
    S.run_property("interpreter: attention core", _check_core, INTERPRETER_CORE,
                   explicit=[CORE_EXAMPLE], max_examples=S.profile_examples(15))


@pytest.mark.parametrize("plant", plants.plants_for("core"))
def test_attention_core_property_catches(triton_interpreter, plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"interpreter: attention core + {plant}", _check_core,
                       INTERPRETER_CORE, explicit=[CORE_EXAMPLE], **S.PLANT_SETTINGS)


def test_interpreter_core_bounds_separate_bf16x3_from_one_bf16_product(triton_interpreter):
    """The bounds are tight enough to matter: one plain bf16 product per matmul (what a
    dropped lo term gives) lands above every bound."""
    case = CORE_EXAMPLE
    logical, _ = S.core_inputs(case, "cpu")
    want = S.core_reference(*(logical[n] for n in S.CORE_TENSORS), case.scale)
    bf16 = S.core_reference(*(plants.round_bf16(logical[n]) for n in S.CORE_TENSORS),
                            case.scale)
    errors = S.core_errors([b.float() for b in bf16], want, case.seq_len)
    for name, err in errors.items():
        assert err > S.CORE_BOUNDS_INTERPRETER[name], (name, err)


# --- the compiled CPU path -----------------------------------------------------------

# each new (shape, scale, eps, mode, dtype, batch bucket) is a compile of a few seconds
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
                   explicit=[BLOCK_EXAMPLE], max_examples=S.profile_examples(4, 30))


# the other block plants (settings, recompiles) are invariants of tests/test_stateful.py
BLOCK_PLANTS = ("drop_lo", "round_out", "drop_last_token", "exact_ln", "mutate_input")


@pytest.mark.parametrize("plant", BLOCK_PLANTS)
def test_compiled_cpu_property_catches(plant):
    with plants.planted(plant), pytest.raises(AssertionError):
        S.run_property(f"compiled CPU path + {plant}", _check_compiled_cpu, COMPILED_CPU,
                       explicit=[BLOCK_EXAMPLE], **S.PLANT_SETTINGS)
