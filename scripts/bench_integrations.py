"""timm and OpenCLIP ViT-L/14-336 vision towers (577 tokens, 1024 wide, 16 heads,
--layers blocks, random init, no download), stock against the same tower after
vitattn_bwd.integrations.swap_attention: the fwd+bwd time of a training step (all
parameters), in float32 (TF32 as the process has it, off by default) and under
torch.autocast(bfloat16), at several batch sizes. Prints one markdown table.

    python scripts/bench_integrations.py [--libs timm open_clip] [--batch-sizes 1 8 32]
                                         [--layers 4] [--precisions fp32 bf16]

Median of rounds x repeats steps per model, the two models taking turns in rounds (as
scripts/bench_module.py), after one untimed step each (compiles, autotunes, captures).
Under autocast the swapped blocks run through vitattn_bwd.module.vision_attention, and so
do whatever it does there (the one-product path in bf16 with the fused backward, where it
runs); the stock blocks run bf16 matmuls and bf16 SDPA.
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd.integrations import swap_attention, swapped_layers  # noqa: E402

IMAGE, PATCH, EMBED, HEADS = 336, 14, 1024, 16


def timm_tower(layers):
    import timm
    return timm.create_model("vit_large_patch14_clip_336", pretrained=False, depth=layers,
                             num_classes=0)


def open_clip_tower(layers):
    from open_clip.transformer import VisionTransformer
    return VisionTransformer(image_size=IMAGE, patch_size=PATCH, width=EMBED, layers=layers,
                             heads=HEADS, mlp_ratio=4.0, output_dim=768)


TOWERS = {"timm": timm_tower, "open_clip": open_clip_tower}


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def make_step(model, pixels, precision):
    def step():
        model.zero_grad(set_to_none=True)
        if precision == "bf16":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = _out(model(pixels))
        else:
            out = _out(model(pixels))
        out.float().pow(2).mean().backward()
    return step


def step_ms(steps, rounds, repeats):
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--libs", nargs="+", default=list(TOWERS), choices=list(TOWERS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_integrations needs a CUDA GPU")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {args.layers} "
          f"blocks, {(IMAGE // PATCH) ** 2 + 1} tokens, {EMBED} wide, {HEADS} heads; TF32 "
          f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'} for torch matmuls; "
          f"median of {args.rounds}x{args.repeats} steps", flush=True)
    print("\n| library | precision | batch | stock ms | swapped ms | speedup |")
    print("|---|---|---|---|---|---|", flush=True)
    for lib in args.libs:
        try:
            torch.manual_seed(0)
            stock = TOWERS[lib](args.layers).cuda().train()
        except ImportError as err:
            print(f"| {lib} | - | - | not installed ({err}) | | |", flush=True)
            continue
        ours = swap_attention(copy.deepcopy(stock))
        assert len(swapped_layers(ours)) == args.layers
        for precision in args.precisions:
            for B in args.batch_sizes:
                pixels = torch.randn(B, 3, IMAGE, IMAGE, device="cuda")
                ms = step_ms({"stock": make_step(stock, pixels, precision),
                              "ours": make_step(ours, pixels, precision)},
                             args.rounds, args.repeats)
                print(f"| {lib} | {precision} | {B} | {ms['stock']:.3f} | {ms['ours']:.3f} "
                      f"| {ms['stock'] / ms['ours']:.2f}x |", flush=True)
        del stock, ours
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
