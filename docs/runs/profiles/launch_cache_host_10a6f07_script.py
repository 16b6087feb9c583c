"""Host time with launcher.launch's cache against triton's JIT path on every call
(launcher.launch replaced by kernel[grid](...)): the warp-specialized backward's
launcher alone, the deterministic attention's fwd + bwd (and SDPA's), a
VisionAttentionBlock step under bf16 autocast with our attention
(routing.OUR_ATTENTION_MIN_BATCH = 1) and the stock block, and the float32 "high"
block step at batch 32 (the compiled graph's Gluon choices launch through
gluon_core). GPU kept busy (profile_host.host_us); alternated rounds, medians. Also:
both ways give the same bits."""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profile_host import host_us  # noqa: E402
from profile_kernels import module_step  # noqa: E402
from vitattn_bwd import attention_bwd_ws, deterministic_sdpa as ds, launcher, routing  # noqa: E402
from vitattn_bwd.attention_fwd import attention_fwd_half  # noqa: E402
from vitattn_bwd.layout import qkv_heads  # noqa: E402

ROUNDS = 5
cached_launch = launcher.launch


def jit_launch(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def jit(step):
    def run():
        launcher.launch = jit_launch
        try:
            return step()
        finally:
            launcher.launch = cached_launch
    return run


def table(label, steps, calls):
    times = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            times[name].append(host_us(step, calls))
    row = "  ".join(f"{n} {statistics.median(t):7.1f} ({min(t):.0f}-{max(t):.0f})"
                    for n, t in times.items())
    print(f"{label}: host us: {row}", flush=True)


def launcher_level(batch):
    torch.manual_seed(0)
    qkv = torch.randn(batch, 577, 3072, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv_heads(qkv, 16)
    g = torch.randn(batch, 577, 1024, device="cuda", dtype=torch.bfloat16)
    out, lse = attention_fwd_half(q, k, v, 0.125)
    out = out.contiguous()
    step = lambda: attention_bwd_ws.launch(q, k, v, g, out, lse, 0.125)  # noqa: E731
    same = torch.equal(step(), jit(step)())
    table(f"attention_bwd_ws.launch, batch {batch:2d}, bitwise same {same}",
          {"cache": step, "jit": jit(step)}, 40)


def attention_level(batch):
    torch.manual_seed(0)
    qkv = torch.randn(batch, 577, 3072, device="cuda", dtype=torch.bfloat16,
                      requires_grad=True)
    g = torch.randn(batch, 577, 1024, device="cuda", dtype=torch.bfloat16)

    def ours():
        ds.attention(qkv, 16).backward(g)

    def sdpa():
        q, k, v = qkv_heads(qkv, 16)
        a = F.scaled_dot_product_attention(q, k, v)
        a.transpose(1, 2).reshape(batch, 577, 1024).backward(g)
    table(f"attention fwd+bwd, batch {batch:2d}",
          {"cache": ours, "jit": jit(ours), "sdpa": sdpa}, 40)


def block_level(batch, autocast):
    routing.OUR_ATTENTION_MIN_BATCH = 1
    ours = module_step(batch, autocast, stock=False)
    stock = module_step(batch, autocast, stock=True)
    label = "autocast" if autocast else f"float32 {torch.get_float32_matmul_precision()}"
    table(f"block step, {label}, batch {batch:2d}",
          {"cache": ours, "jit": jit(ours), "stock": stock}, 20)


if __name__ == "__main__":
    sections = sys.argv[1:] or ["launcher", "attention", "block", "float32"]
    if "launcher" in sections:
        for b in (1, 8, 32):
            launcher_level(b)
    if "attention" in sections:
        for b in (1, 8, 32):
            attention_level(b)
    if "block" in sections:
        for b in (8, 16, 32):
            block_level(b, True)
    if "float32" in sections:
        torch.set_float32_matmul_precision("high")
        start = time.perf_counter()
        block_level(32, False)
        print(f"(float32 row incl. compile: {time.perf_counter() - start:.0f} s)")
