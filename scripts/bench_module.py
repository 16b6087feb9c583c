"""VisionAttentionBlock against the plain PyTorch block (LayerNorm, Linear, SDPA, Linear):
forward + backward time and the memory each keeps for its backward. Then, when
transformers is installed, a CLIP vision tower (ViT-L/14-336 on CUDA: 577 tokens, 1024
wide, 16 heads, --hf-layers layers) stock against the same tower after
vitattn_bwd.integrations.hf.swap_attention: fwd+bwd ms of a training step, memory kept
for the backward per image, and the step's peak memory.

    python scripts/bench_module.py [--batch-sizes 1 8 32] [--hf-layers 4] [--no-hf]
                                   [--autocast] [--precisions highest high]
                                   [--dtype float32|bfloat16|float16]

float32 parameters (--dtype: bf16 / fp16 parameters and inputs, the native path); TF32
is left as the process has it (off by default) and printed.
The block table has a VisionAttentionBlock per precision in --precisions (default
"highest" and "high"; "default" is precision None, which follows torch's float32 matmul
precision, "highest" unless the process set it) beside the plain block. With --autocast
every forward runs under torch.autocast(bfloat16) (backward outside it, as in a training
loop) and the default precisions are None (the stock ops under autocast; from
routing.OUR_ATTENTION_MIN_BATCH images with our attention backward) and "high" (keeps the
float32-grade fused path). The tower is swapped with
precision None.
"""
import argparse
import contextlib
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import VisionAttentionBlock, reference  # noqa: E402


NO_AUTOCAST = contextlib.nullcontext
AUTOCAST_NOTE = ", forwards under torch.autocast(bfloat16)"


def step_times(step, device, repeats):
    """ms of `repeats` calls of step(), each timed from a synchronized start to its end."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def compare_times(steps, device, rounds=5, repeats=10):
    """ms of every timed call of each of `steps` (name -> step), after one untimed call
    each (compiles, autotunes, captures): the steps take turns, `rounds` times `repeats`
    calls each, so that a drift of the machine's speed during the run falls on all of
    them alike."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name] += step_times(step, device, repeats)
    return times


def compare_ms(steps, device, rounds=5, repeats=10):
    """Median ms of each of `steps` (compare_times)."""
    return {name: statistics.median(t)
            for name, t in compare_times(steps, device, rounds, repeats).items()}


def _block_step(model, x, grad, amp):
    with amp():
        y = model(x)
    y.backward(grad.to(y.dtype))


def saved_mb(model, x, device, amp):
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with amp():
        y = model(x)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept / 2 ** 20


def hf_tower(device, layers):
    """A random-init CLIPVisionModel: ViT-L/14-336 on CUDA, a 65-token one on the CPU."""
    from transformers import CLIPVisionConfig, CLIPVisionModel
    if device == "cuda":
        size = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                    image_size=336, patch_size=14)
    else:
        size = dict(hidden_size=128, intermediate_size=512, num_attention_heads=4,
                    image_size=64, patch_size=8)
    torch.manual_seed(0)
    config = CLIPVisionConfig(num_hidden_layers=layers, hidden_act="quick_gelu", **size)
    return CLIPVisionModel(config).to(device).train()


def hf_step(model, pixels, grad, amp):
    def step():
        model.zero_grad(set_to_none=True)
        with amp():
            out = model(pixel_values=pixels).last_hidden_state
        out.backward(grad.to(out.dtype))
    return step


def hf_memory_mb(model, pixels, grad, device, amp):
    """(MB kept for the backward per image, peak MB of one fwd+bwd step above what was
    allocated before it); NaN off CUDA."""
    if device != "cuda":
        return float("nan"), float("nan")
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with amp():
        out = model(pixel_values=pixels)
    outputs = sum(t.numel() * t.element_size()
                  for t in (out.last_hidden_state, out.pooler_output))
    kept = torch.cuda.memory_allocated() - before - outputs
    out.last_hidden_state.backward(grad.to(out.last_hidden_state.dtype))
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    model.zero_grad(set_to_none=True)
    return kept / pixels.shape[0] / 2 ** 20, peak / 2 ** 20


def bench_hf(device, batch_sizes, layers, amp, dtype=torch.float32):
    try:
        from vitattn_bwd.integrations.hf import swap_attention
        stock = hf_tower(device, layers).to(dtype)
    except ImportError:
        print("\n(transformers is not installed: no Hugging Face comparison; "
              "pip install -e '.[hf]')")
        return
    ours = swap_attention(copy.deepcopy(stock))
    c = stock.config
    tokens = (c.image_size // c.patch_size) ** 2 + 1
    print(f"\nHugging Face CLIPVisionModel, {layers} layers, {tokens} tokens, "
          f"{c.hidden_size} wide, {c.num_attention_heads} heads, {dtype}; training step "
          f"(fwd+bwd of all parameters){AUTOCAST_NOTE if amp is not NO_AUTOCAST else ''}")
    print("\n| batch | stock ms | swapped ms | speedup | stock kept MB/image | "
          "swapped kept MB/image | stock peak MB | swapped peak MB |")
    print("|---|---|---|---|---|---|---|---|")
    for B in batch_sizes:
        pixels = torch.randn(B, 3, c.image_size, c.image_size, device=device, dtype=dtype)
        grad = torch.randn(B, tokens, c.hidden_size, device=device, dtype=dtype)
        times = list(compare_ms({"stock": hf_step(stock, pixels, grad, amp),
                                 "ours": hf_step(ours, pixels, grad, amp)}, device).values())
        memory = [hf_memory_mb(m, pixels, grad, device, amp) for m in (stock, ours)]
        print(f"| {B} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.2f}x | "
              f"{memory[0][0]:.1f} | {memory[1][0]:.1f} | {memory[0][1]:.0f} | "
              f"{memory[1][1]:.0f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--hf-layers", type=int, help="layers of the Hugging Face tower "
                        "(default: 4 on CUDA, 2 on the CPU)")
    parser.add_argument("--no-hf", action="store_true",
                        help="skip the Hugging Face comparison")
    parser.add_argument("--autocast", action="store_true",
                        help="forwards under torch.autocast(bfloat16)")
    parser.add_argument("--precisions", nargs="+",
                        choices=("default", "highest", "high", "medium"),
                        help="the blocks' precisions (default: highest high; with "
                        "--autocast or --dtype bfloat16/float16: default high)")
    parser.add_argument("--dtype", default="float32",
                        choices=("float32", "bfloat16", "float16"),
                        help="the dtype of the parameters and inputs (bfloat16 / float16: "
                        "the blocks and towers run natively in it, `.to(dtype)`)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seq_len, embed_dim, heads = (577, 1024, 16) if device == "cuda" else (65, 128, 4)
    batch_sizes = args.batch_sizes or ((1, 8, 32) if device == "cuda" else (1, 4))
    amp = (functools.partial(torch.autocast, device, torch.bfloat16) if args.autocast
           else NO_AUTOCAST)
    precisions = args.precisions or (("default", "high")
                                     if args.autocast or dtype != torch.float32
                                     else ("highest", "high"))
    torch.manual_seed(0)
    block = VisionAttentionBlock(embed_dim, heads).to(device, dtype)
    models = {}
    for precision in precisions:
        model = VisionAttentionBlock(embed_dim, heads,
                                     precision=None if precision == "default" else precision)
        model.load_state_dict(block.state_dict())
        models[f"vitattn {precision}"] = model.to(device, dtype)
    models["plain_sdpa"] = reference.ReferenceBlock(block)
    print(f"{device}: {seq_len} tokens, {embed_dim} wide, {heads} heads; {args.dtype} "
          f"parameters{AUTOCAST_NOTE if args.autocast else ''} (TF32 "
          f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'} for torch matmuls)")
    print("\n| batch | " + " | ".join(f"{n} fwd+bwd ms | {n} kept MB" for n in models) + " |")
    print("|---|" + "---|---|" * len(models))
    for B in batch_sizes:
        x = torch.randn(B, seq_len, embed_dim, device=device, dtype=dtype,
                        requires_grad=True)
        grad = torch.randn_like(x)
        times = compare_ms({name: functools.partial(_block_step, model, x, grad, amp)
                            for name, model in models.items()}, device)
        cells = []
        for name, model in models.items():
            cells += [f"{times[name]:.3f}", f"{saved_mb(model, x, device, amp):.0f}"]
        print(f"| {B} | " + " | ".join(cells) + " |", flush=True)
    if not args.no_hf:
        bench_hf(device, batch_sizes, args.hf_layers or (4 if device == "cuda" else 2), amp,
                 dtype)


if __name__ == "__main__":
    main()
