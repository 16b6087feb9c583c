"""How close each precision of the swapped block comes to float64, against the stock
float32 model's own error: a Hugging Face CLIP vision tower at ViT-L/14-336 size (577
tokens, 1024 wide, 16 heads; --layers layers, random weights, LayerNorm parameters off 1
and 0), one forward and backward of a weighted-sum loss, TF32 off.

    PYTHONPATH=. python3 scripts/tower_accuracy.py [--layers 4] [--batch 2] [--json F]
                                                   [--autocast]

For the stock model in float32 and for the swapped model at each precision
(VisionAttentionBlock's "highest" and "high"), the relative error against the float64
stock model of the last hidden state and of every parameter's gradient (k_proj.bias,
zero in exact math, against its layer's q/k/v bias gradients). Prints per precision the
largest ratio of our error to the stock float32 model's error over the gradients
(issue 24's yardstick: "highest" within 10x), and the gradients where it is largest.
With --autocast, two more rows: the stock and the swapped model (precision None) with
their forwards under torch.autocast(bfloat16), the swapped one's ratios against the
stock one's under the same autocast (issue 24: no worse than stock's).
"""
import argparse
import contextlib
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd.integrations.hf import swap_attention  # noqa: E402

SEQ, EMBED, HEADS, IMAGE, PATCH, MLP = 577, 1024, 16, 336, 14, 4096


def tower(layers):
    from transformers import CLIPVisionConfig, CLIPVisionModel
    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=EMBED, intermediate_size=MLP,
                              num_attention_heads=HEADS, num_hidden_layers=layers,
                              image_size=IMAGE, patch_size=PATCH, hidden_act="quick_gelu")
    model = CLIPVisionModel(config).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def hidden_and_grads(model, pixels, weight, autocast=False):
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    region = (torch.autocast("cuda", torch.bfloat16) if autocast
              else contextlib.nullcontext())
    with region:
        out = model(pixel_values=pixels.to(dtype))
    ((out.last_hidden_state * weight.to(dtype)).sum() + out.pooler_output.pow(2).sum()
     ).backward()
    return out.last_hidden_state.detach(), {n: p.grad.detach().clone()
                                           for n, p in model.named_parameters()}


def errors(hidden, grads, hidden64, grads64):
    result = {"last_hidden_state": ((hidden.double() - hidden64).norm()
                                    / hidden64.norm()).item()}
    for name, g in grads.items():
        denom = grads64[name].norm()
        if name.endswith("k_proj.bias"):
            layer = name[:-len("k_proj.bias")]
            denom = torch.cat([grads64[layer + p + "_proj.bias"] for p in "qkv"]).norm()
        result[name] = ((g.double() - grads64[name]).norm() / denom).item()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", default=["highest", "high"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--autocast", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False       # a script: its own process
    torch.backends.cudnn.allow_tf32 = False
    stock = tower(args.layers)
    g = torch.Generator(device="cuda").manual_seed(1)
    pixels = torch.randn(args.batch, 3, IMAGE, IMAGE, device="cuda", generator=g)
    weight = torch.randn(args.batch, SEQ, EMBED, device="cuda", generator=g)
    hidden64, grads64 = hidden_and_grads(copy.deepcopy(stock).double(), pixels,
                                         weight.double())
    table = {"stock float32": errors(*hidden_and_grads(stock, pixels, weight), hidden64,
                                     grads64)}
    for precision in args.precisions:
        ours = swap_attention(copy.deepcopy(stock), precision=precision)
        table[precision] = errors(*hidden_and_grads(ours, pixels, weight), hidden64,
                                  grads64)
    # each row against the stock row of its own arithmetic
    baseline = dict.fromkeys(table, "stock float32")
    if args.autocast:
        table["stock bf16 autocast"] = errors(
            *hidden_and_grads(stock, pixels, weight, autocast=True), hidden64, grads64)
        table["ours bf16 autocast"] = errors(
            *hidden_and_grads(swap_attention(copy.deepcopy(stock)), pixels, weight,
                              autocast=True), hidden64, grads64)
        baseline.update({"stock bf16 autocast": "stock float32",
                         "ours bf16 autocast": "stock bf16 autocast"})
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    print(f"{'precision':20} {'output err':>10} {'output/stock':>12} {'worst grad/stock':>16}"
          "  worst gradients (ours / stock), stock: that row's baseline")
    for precision, errs in table.items():
        stock_errors = table[baseline[precision]]
        ratios = {n: errs[n] / stock_errors[n] for n in errs if n != "last_hidden_state"}
        worst = sorted(ratios, key=ratios.get, reverse=True)[:3]
        detail = ", ".join(f"{n} {errs[n]:.1e}/{stock_errors[n]:.1e}" for n in worst)
        print(f"{precision:20} {errs['last_hidden_state']:10.2e} "
              f"{errs['last_hidden_state'] / stock_errors['last_hidden_state']:12.1f} "
              f"{ratios[worst[0]]:16.1f}  {detail}")


if __name__ == "__main__":
    main()
