"""VisionAttentionBlock against the plain PyTorch block (LayerNorm, Linear, SDPA, Linear):
forward + backward time and the memory each keeps for its backward.

    python scripts/bench_module.py [--batch-sizes 1 8 32]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import VisionAttentionBlock, reference  # noqa: E402


def step_ms(model, x, grad, device, repeats=10):
    def step():
        model(x).backward(grad)
    step()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def saved_mb(model, x, device):
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = model(x)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept / 2 ** 20


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seq_len, embed_dim, heads = (577, 1024, 16) if device == "cuda" else (65, 128, 4)
    batch_sizes = args.batch_sizes or ((1, 8, 32) if device == "cuda" else (1, 4))
    torch.manual_seed(0)
    block = VisionAttentionBlock(embed_dim, heads).to(device)
    models = {"vitattn": block, "plain_sdpa": reference.ReferenceBlock(block)}
    print(f"{device}: {seq_len} tokens, {embed_dim} wide, {heads} heads; float32 "
          f"(TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'} for torch matmuls)")
    print("\n| batch | " + " | ".join(f"{n} fwd+bwd ms | {n} kept MB" for n in models) + " |")
    print("|---|" + "---|---|" * len(models))
    for B in batch_sizes:
        x = torch.randn(B, seq_len, embed_dim, device=device, requires_grad=True)
        grad = torch.randn_like(x)
        cells = []
        for model in models.values():
            cells += [f"{step_ms(model, x, grad, device):.3f}", f"{saved_mb(model, x, device):.0f}"]
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
