"""How much smaller dQ and dK are than the terms that cancel into them (tests/strategies.py
cancelled_terms / core_errors), on the CPU in float64: the case the GPU property run of
10a6f07 drew (gpu_tests_10a6f07_xdist.log: grad_q 9.9e-5 against its norm), and the
ratio terms / norm over seeds at a few token counts. Run from the repository root."""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests import strategies as S  # noqa: E402


def ratios(case):
    logical, _ = S.core_inputs(case, torch.device("cpu"))
    probs = S.core_probabilities(logical, case.scale)
    want = S.core_reference(probs, *(logical[n] for n in S.CORE_TENSORS[1:]), case.scale)
    terms = S.cancelled_terms(probs, logical, case.scale)
    return [t / w.norm().item() for t, w in zip(terms, want[:2])]


def case(seq_len, head_dim, seed, heads=1, scale=0.25):
    return S.CoreCase(batch=1, heads=heads, seq_len=seq_len, head_dim=head_dim, scale=scale,
                      seed=seed, p_source="qk", layouts=("contiguous",) * 5, offset=1,
                      block_m=None, block_n=None)


drawn = case(2, 16, 1)
dq, dk = ratios(drawn)
print(f"the drawn case {drawn}: terms / norm dQ {dq:.2f}, dK {dk:.2f}; grad_q's 9.9e-5 "
      f"against its norm is {9.9e-5 / dq:.2e} against the terms (bound 5e-5)")
for seq_len, head_dim, seeds in ((2, 16, 200), (3, 16, 200), (7, 64, 50), (100, 16, 20),
                                 (100, 64, 20), (577, 64, 5)):
    values = sorted(r for seed in range(seeds) for r in ratios(case(seq_len, head_dim, seed)))
    print(f"{seq_len:4d} tokens, head dim {head_dim:3d}, {seeds} seeds: terms / norm of dQ "
          f"and dK median {statistics.median(values):.2f}, 95th percentile "
          f"{values[int(0.95 * len(values))]:.2f}, max {values[-1]:.2f}")
