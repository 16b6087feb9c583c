"""Host time of the stock route's forward on a CPU core against the stock ops
(reference.block_forward / ReferenceBlock), under bf16 autocast: a block 64 wide, 4
heads, 8 tokens, x requiring grad; medians of 5,000 calls, each figure the median of 3
rounds. The head split as a chunk and a view and transpose per part (qkv_heads before
4f15110) against one view, permute and unbind (after). Run from the repository root."""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from vitattn_bwd import VisionAttentionBlock, layout, module, reference, validation  # noqa: E402


def median_us(fn, calls=5000):
    for _ in range(300):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def chunked_heads(qkv, num_heads):
    return tuple(layout.split_heads(t, num_heads) for t in qkv.chunk(3, dim=-1))


torch.manual_seed(0)
block = VisionAttentionBlock(embed_dim=64, num_heads=4)
stock = reference.ReferenceBlock(block)
x = torch.randn(1, 8, 64, requires_grad=True)
grad = torch.randn(1, 8, 64)
params = (block.norm.weight, block.norm.bias, block.qkv.weight, block.qkv.bias,
          block.out_proj.weight, block.out_proj.bias)
qkv = torch.randn(1, 8, 192)
split_heads_now = module.qkv_heads


def backward_us(model):
    def once():
        with torch.autocast("cpu", torch.bfloat16):
            y = model(x)
        start = time.perf_counter_ns()
        y.backward(grad)
        return time.perf_counter_ns() - start
    for _ in range(300):
        once()
    return statistics.median(once() for _ in range(5000)) / 1000


def stub_stock_forward(*args, **kwargs):
    return args[0]


rows = {
    "qkv_heads, chunk + view + transpose per part": lambda: chunked_heads(qkv, 4),
    "qkv_heads, view + permute + unbind": lambda: layout.qkv_heads(qkv, 4),
    "stock ops (reference.block_forward)": lambda: reference.block_forward(x, *params, 4, 1e-5),
    "stock_forward, chunked heads": lambda: (setattr(module, "qkv_heads", chunked_heads),
                                             module.stock_forward(x, *params, 4, 1e-5)),
    "stock_forward, view + permute + unbind": lambda: (
        setattr(module, "qkv_heads", split_heads_now), module.stock_forward(x, *params, 4, 1e-5)),
    "VisionAttentionBlock forward": lambda: block(x),
    "ReferenceBlock forward": lambda: stock(x),
    "check_block_inputs": lambda: validation.check_block_inputs(x, params, 4, 1e-5),
}
with torch.autocast("cpu", torch.bfloat16):
    results = {name: [] for name in rows}
    for _ in range(3):
        for name, fn in rows.items():
            results[name].append(median_us(fn))
    module.qkv_heads = split_heads_now
    real_stock_forward = module.stock_forward
    module.stock_forward = stub_stock_forward
    checks_and_route = statistics.median(
        median_us(lambda: module.vision_attention(x, *params, 4, 1e-5)) for _ in range(3))
    module.stock_forward = real_stock_forward
for name, values in results.items():
    print(f"{name:48s} {statistics.median(values):7.1f} us")
print(f"{'vision_attention, stock_forward stubbed':48s} {checks_and_route:7.1f} us")
backward = {"backward, VisionAttentionBlock": (block, []), "backward, ReferenceBlock": (stock, [])}
for _ in range(3):                                        # alternated rounds
    for model, values in backward.values():
        values.append(backward_us(model))
for name, (_, values) in backward.items():
    print(f"{name:48s} {statistics.median(values):7.1f} us  {[round(v) for v in values]}")
