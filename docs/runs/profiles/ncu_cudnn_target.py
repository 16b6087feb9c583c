# ruff: noqa  (an archived one-off ncu target, kept as it ran on the H200)
import sys; sys.path[:0]=[".","scripts"]
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
from time_core_half import SCALE, make_inputs
q, k, v, grad_attn, attn_output, lse = make_inputs(32, torch.bfloat16, seed=32)
q, k, v = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(2):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=SCALE)
        out.backward(torch.randn_like(out))
torch.cuda.synchronize()
