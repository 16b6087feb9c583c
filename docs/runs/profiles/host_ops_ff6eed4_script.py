"""Host time per call of deterministic_sdpa's operators, of the backward's launcher and of
SDPA's forward + backward, with the GPU kept busy (profile_host.host_us), batch 1 / 8 / 32;
cProfile of the two operators at batch 8. A one-off: it ran as tmp_probe/ops_host.py at
the repository root (the sys.path lines below assume that place)."""
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profile_host import host_us  # noqa: E402
from vitattn_bwd import attention_bwd_ws as ws  # noqa: E402
from vitattn_bwd import deterministic_sdpa as ds  # noqa: E402
from vitattn_bwd.layout import qkv_heads  # noqa: E402


def main(batch):
    torch.manual_seed(0)
    qkv = torch.randn(batch, 577, 3072, device="cuda", dtype=torch.bfloat16)
    attn, lse = torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, 16)
    g = torch.randn_like(attn)
    q, k, v = qkv_heads(qkv, 16)
    res = {}
    res["ours fwd op"] = host_us(lambda: torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, 16), 50)
    res["ours bwd op"] = host_us(
        lambda: torch.ops.vitattn_bwd.sdpa_ws_bwd(g, qkv, attn, lse, 16), 50)
    res["launch"] = host_us(
        lambda: ws.launch(q, k, v, g, attn, lse, 0.125, ws.FASTEST_TILES), 50)
    res["launch_delta"] = host_us(lambda: ws.launch_delta(g, attn, lse, 16, 128), 50)
    qkv_r = qkv.detach().requires_grad_()

    def ours_fb():
        ds.attention(qkv_r, 16).backward(g)
    res["ours fwd+bwd autograd"] = host_us(ours_fb, 50)

    def sdpa_fb():
        qq, kk, vv = qkv_heads(qkv_r, 16)
        a = F.scaled_dot_product_attention(qq, kk, vv)
        a.transpose(1, 2).reshape(batch, 577, 1024).backward(g)
    res["sdpa fwd+bwd autograd"] = host_us(sdpa_fb, 50)
    for name, us in res.items():
        print(f"batch {batch} {name:24s} {us:8.1f} us")
    if batch == 8:
        for name, fn in (
                ("bwd op", lambda: torch.ops.vitattn_bwd.sdpa_ws_bwd(g, qkv, attn, lse, 16)),
                ("fwd op", lambda: torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, 16))):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(1e9))
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(50):
                fn()
            profiler.disable()
            torch.cuda.synchronize()
            for order, rows in (("cumulative", 45), ("tottime", 25)):
                stream = io.StringIO()
                pstats.Stats(profiler, stream=stream).sort_stats(order).print_stats(rows)
                if order == "cumulative":
                    print("=====", name)
                print(stream.getvalue())


for b in (1, 8, 32):
    main(b)
