"""Host us of the stock route vs the stock block, alternated, and cProfile of each
(run on the H200 from the repository root as tmp_probe/host_route.py; imports sorted
since, for ruff)."""
import cProfile
import io
import os
import pstats
import statistics
import sys
import torch
sys.path.insert(0, "scripts")
from profile_host import host_us
from vitattn_bwd import VisionAttentionBlock, reference

out = os.environ.get("OUT", ".")
dev = "cuda"
for batch in (1, 8):
    torch.manual_seed(0)
    block = VisionAttentionBlock(1024, 16).to(dev)
    models = {"stock": reference.ReferenceBlock(block), "swapped": block}
    x = torch.randn(batch, 577, 1024, device=dev, requires_grad=True)
    grad = torch.randn_like(x)
    steps = {}
    for name, m in models.items():
        def step(m=m):
            with torch.autocast("cuda", torch.bfloat16):
                y = m(x)
            y.backward(grad.to(y.dtype))
        steps[name] = step
    res = {k: [] for k in steps}
    for r in range(7):
        for name, step in steps.items():
            res[name].append(host_us(step, 20))
    print(batch, {k: (round(statistics.median(v)), [round(t) for t in v]) for k, v in res.items()}, flush=True)
    for name, step in steps.items():
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        torch.cuda._sleep(int(2e9))
        pr.enable()
        for _ in range(30):
            step()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        open(f"{out}/prof_{name}_b{batch}.txt", "w").write(s.getvalue())
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(40)
        open(f"{out}/prof_{name}_b{batch}_cum.txt", "w").write(s.getvalue())
