"""One-off diagnostic (issue 23 helper): is the fused backward's QKV-weight gradient
(one fp16 GEMM) accurate when the upstream gradient is small, as in a mean loss?
VisionAttentionBlock at ViT-L/14-336 size, batch 2, grad_y = randn * s; relative error of
every gradient against float64 autograd. In exact float32 the errors do not depend on s."""
import torch
from vitattn_bwd import VisionAttentionBlock, reference
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
block = VisionAttentionBlock(1024, 16).cuda()
with torch.no_grad():
    for p in block.parameters():
        if p.dim() == 1:
            p.add_(torch.randn_like(p) * 0.1)
x = torch.randn(2, 577, 1024, device="cuda")
g0 = torch.randn_like(x)
names = ["x"] + [n for n, _ in block.named_parameters()]
params64 = [p.detach().double().requires_grad_() for p in block.parameters()]
x64 = x.double().requires_grad_()
y64 = reference.block_forward(x64, *params64, num_heads=16, eps=block.eps)
print("scale | " + " | ".join(names))
for s in (1.0, 1e-3, 1e-5, 1e-6, 1e-7, 1e-8):
    want = torch.autograd.grad(y64, [x64, *params64], g0.double() * s, retain_graph=True)
    xg = x.detach().requires_grad_()
    got = torch.autograd.grad(block(xg), [xg, *block.parameters()], g0 * s)
    errs = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want)]
    print(f"{s:.0e} | " + " | ".join(f"{e:.1e}" for e in errs), flush=True)
