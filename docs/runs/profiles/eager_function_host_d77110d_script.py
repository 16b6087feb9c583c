"""Host time of the deterministic attention's eager calls: through the operators (the
dispatcher and register_autograd) against the autograd.Function, and SDPA, with the GPU
kept busy (profile_host.host_us); a VisionAttentionBlock step under bf16 autocast with
our attention (routing.OUR_ATTENTION_MIN_BATCH = 1) either way, and the stock block.
Alternated A/B/C rounds, medians. Also: both ways give the same bits. A one-off: it ran
as tmp_probe/eager_function_host.py at the repository root."""
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profile_host import host_us  # noqa: E402
from profile_kernels import module_step  # noqa: E402
from vitattn_bwd import deterministic_sdpa as ds, routing  # noqa: E402
from vitattn_bwd.layout import qkv_heads  # noqa: E402


def through_operators(qkv, num_heads):
    return torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, num_heads)[0]


function_way = ds.attention
ROUNDS = 5


def attention_level(batch):
    torch.manual_seed(0)
    qkv = torch.randn(batch, 577, 3072, device="cuda", dtype=torch.bfloat16,
                      requires_grad=True)
    g = torch.randn(batch, 577, 1024, device="cuda", dtype=torch.bfloat16)
    outs = []
    for way in (through_operators, function_way):
        attn = way(qkv, 16)
        outs.append((attn, torch.autograd.grad(attn, qkv, g)[0]))
    same = all(torch.equal(a, b) for a, b in zip(*outs))

    def sdpa():
        q, k, v = qkv_heads(qkv, 16)
        a = F.scaled_dot_product_attention(q, k, v)
        a.transpose(1, 2).reshape(batch, 577, 1024).backward(g)
    steps = {"operators": lambda: through_operators(qkv, 16).backward(g),
             "function": lambda: function_way(qkv, 16).backward(g),
             "sdpa": sdpa}
    times = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            times[name].append(host_us(step, 40))
    row = "  ".join(f"{n} {statistics.median(t):7.1f} ({min(t):.0f}-{max(t):.0f})"
                    for n, t in times.items())
    print(f"attention fwd+bwd, batch {batch:2d}: bitwise same {same}; host us: {row}",
          flush=True)


def block_level(batch):
    routing.OUR_ATTENTION_MIN_BATCH = 1
    ours = module_step(batch, True, stock=False)
    stock = module_step(batch, True, stock=True)

    def ours_operators():
        ds.attention = through_operators
        try:
            ours()
        finally:
            ds.attention = function_way
    steps = {"ours, operators": ours_operators, "ours, function": ours, "stock": stock}
    times = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            times[name].append(host_us(step, 20))
    row = "  ".join(f"{n} {statistics.median(t):7.0f} ({min(t):.0f}-{max(t):.0f})"
                    for n, t in times.items())
    print(f"block step, autocast, batch {batch:2d}: host us: {row}", flush=True)


for b in (1, 8, 32):
    attention_level(b)
for b in (8, 16):
    block_level(b)
