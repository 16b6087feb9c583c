# ruff: noqa  (an archived one-off ncu target, kept as it ran on the H200)
"""One launch of the warp-specialized core (a configuration of CANDIDATE_TILES) at batch 32, for ncu."""
import sys
sys.path[:0] = [".", "scripts"]
import torch
from time_core_half import SCALE, make_inputs
from vitattn_bwd import attention_bwd_ws
tiles = attention_bwd_ws.WsTiles(*map(int, sys.argv[1].split(",")))
q, k, v, grad_attn, attn_output, lse = make_inputs(32, torch.bfloat16, seed=32)
for _ in range(2):
    attention_bwd_ws.launch(q, k, v, grad_attn, attn_output, lse, SCALE, tiles)
torch.cuda.synchronize()
