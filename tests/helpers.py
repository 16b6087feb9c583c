"""Test helpers: the float64 reference and relative errors."""
import torch

from vitattn_bwd import reference


def reference_grads(inputs, num_heads, ln_grad, dtype=torch.float64, device="cpu"):
    args = {name: (t.to(device=device, dtype=dtype) if torch.is_tensor(t) else t)
            for name, t in inputs.items()}
    return reference.attention_block_backward(**args, num_heads=num_heads, ln_grad=ln_grad)


def relative_errors(outputs, refs):
    return [((o.double() - r.double()).norm() / r.double().norm()).item()
            for o, r in zip(outputs, refs)]
