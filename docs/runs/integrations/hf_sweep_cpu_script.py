"""Hugging Face vision towers at a tiny size on the CPU: swap_attention against the stock
model, eval, float32 and under bf16 autocast: the output, the pixels' gradient and the
worst parameter gradient, each relative to its largest element; which towers are
swapped and which refused (and why). Run from the repository root:

    PYTHONPATH=. python3 docs/runs/integrations/hf_sweep_cpu_script.py [NAME ...]
"""
import copy
import sys

import torch
import transformers

from vitattn_bwd.integrations import swap_attention, swapped_layers

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, image_size=32, patch_size=8)


def relative(a, b):
    return ((a.detach().float() - b.detach().float()).abs().max()
            / (b.detach().float().abs().max() + 1e-12)).item()


def step(model, pixels, autocast):
    """(output, the pixels' gradient, {name: gradient}) of one eval step with a fixed
    random weighting of the output as the loss."""
    model.eval()
    model.zero_grad(set_to_none=True)
    x = pixels.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(pixel_values=x).last_hidden_state
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(123))
    (out.float() * weight).sum().backward()
    return out, x.grad, {n: p.grad for n, p in model.named_parameters()}


def compare(stock, swapped, pixels, label, autocast=False):
    """The parameter gradients' differences are relative to the largest element of any
    parameter's gradient (the keys' bias gradients are ~0 in exact math: their own
    scale would show rounding as a large relative error)."""
    out, grad_x, grads = step(stock, pixels, autocast)
    got, got_x, got_grads = step(swapped, pixels, autocast)
    missing = [n for n in grads if (grads[n] is None) != (got_grads[n] is None)]
    largest = max(g.float().abs().max().item() for g in grads.values() if g is not None)
    worst = max(((got_grads[n].float() - g.float()).abs().max().item() / largest, n)
                for n, g in grads.items() if g is not None and got_grads[n] is not None)
    print(f"[{label}] out {relative(got, out):.1e}  pixels' grad {relative(got_x, grad_x):.1e}"
          f"  worst parameter grad {worst[0]:.1e} ({worst[1]}, of the largest)"
          + (f"  MISSING {missing}" if missing else ""), flush=True)


def build(model_name, config_name, **config):
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))


CASES = {
    "CLIPVisionModel": lambda: build("CLIPVisionModel", "CLIPVisionConfig", **TINY),
    "SiglipVisionModel": lambda: build("SiglipVisionModel", "SiglipVisionConfig", **TINY),
    "AltCLIPVisionModel": lambda: build("AltCLIPVisionModel", "AltCLIPVisionConfig", **TINY),
    "OwlViTVisionModel": lambda: build("OwlViTVisionModel", "OwlViTVisionConfig", **TINY),
    "ChineseCLIPVisionModel": lambda: build("ChineseCLIPVisionModel",
                                            "ChineseCLIPVisionConfig", **TINY),
    "MetaClip2VisionModel": lambda: build("MetaClip2VisionModel", "MetaClip2VisionConfig",
                                          **TINY),
    "Idefics2VisionTransformer": lambda: (
        transformers.models.idefics2.modeling_idefics2.Idefics2VisionTransformer(
            transformers.models.idefics2.configuration_idefics2.Idefics2VisionConfig(**TINY))),
    "Kosmos2VisionModel": lambda: transformers.models.kosmos2.modeling_kosmos2.Kosmos2VisionModel(
        transformers.models.kosmos2.configuration_kosmos2.Kosmos2VisionConfig(**TINY)),
    "ViTModel": lambda: build("ViTModel", "ViTConfig", **TINY),
    "Dinov2Model": lambda: build("Dinov2Model", "Dinov2Config", **TINY),
    "XCLIPVisionModel": lambda: build("XCLIPVisionModel", "XCLIPVisionConfig", **TINY),
    "MLCDVisionModel": lambda: build("MLCDVisionModel", "MLCDVisionConfig", **TINY),
}

if __name__ == "__main__":
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for name, make in CASES.items():
        if sys.argv[1:] and name not in sys.argv[1:]:
            continue
        torch.manual_seed(0)
        try:
            stock = make()
        except Exception as error:                   # not in this transformers
            print(f"[{name}] not built: {type(error).__name__}: {str(error)[:160]}")
            continue
        with torch.no_grad():                         # LayerNorms and biases off 1 and 0
            for parameter_name, p in stock.named_parameters():
                if "norm" in parameter_name or "bias" in parameter_name:
                    p.add_(0.1 * torch.randn_like(p))
        swapped = copy.deepcopy(stock)
        try:
            swap_attention(swapped)
        except ValueError as error:
            print(f"[{name}] refused: {str(error)[:240]}")
            continue
        print(f"[{name}] swapped {len(swapped_layers(swapped))} layers")
        compare(stock, swapped, pixels, f"{name} float32")
        compare(stock, swapped, pixels, f"{name} bf16 autocast", autocast=True)
