"""Vision towers as people train them, stock against swapped (swap_attention, precision
None unless a row says otherwise), every model of a suite side by side in one process so
that each ratio compares runs of the same machine. One invocation runs one suite; each
fits one device call of at most ~8 minutes on a cold H200 (estimates below, from first
compiled steps of 19-25 s per 12-layer model):

    PYTHONPATH=. python3 scripts/bench_towers.py --suite SUITE [--layers N]
        [--batch-sizes ...] [--float32-precisions high highest] [--out DIR]

  autocast       HF CLIP ViT-L/14-336 (--layers, 12 or 24), bf16 autocast, batch 1 8 32:
                 stock, swapped, torch.compile(stock), torch.compile(swapped), and at the
                 largest batch torch.compile(swapped, mode="reduce-overhead")
                 (~4 min at 12 layers, ~7 at 24)
  float32        the same models in float32 at each --float32-precisions, batch 8 32
                 (one precision per call: ~4 min at 12 layers, ~6 at 24)
  integrations   timm vit_large_patch14_clip_336 and OpenCLIP ViT-L/14-336 (4 blocks,
                 batch 32) and a SigLIP so400m-shaped HF tower (hidden 1152, 16 heads of
                 72, 729 tokens, 6 layers, batch 16), float32 and autocast, eager and
                 compiled (~6 min)
  head_dims      HF CLIP towers of OpenCLIP ViT-H/14's shapes (1280 wide, 16 heads of
                 80, MLP 5120) and ViT-bigG/14's (1664 wide, 16 heads of 104, MLP 8192),
                 224 px (257 tokens), 6 layers, batch 32, float32 and autocast, eager and
                 compiled (~5 min)
  deterministic  HF CLIP 12 layers, batch 32, autocast and float32 "high", eager, each
                 model without and with torch.use_deterministic_algorithms(True)
                 (CUBLAS_WORKSPACE_CONFIG=:4096:8 for the whole process): the step times,
                 a bitwise repeat check of every model (--compiled: the compiled towers
                 too, ~+3 min), the flag's cost with
                 torch.utils.deterministic.fill_uninitialized_memory off, and the kernels
                 whose GPU time the flag changes most (~5 min)
  restart        first step of torch.compile(stock) and torch.compile(swapped) (HF CLIP,
                 12 layers, batch 32, autocast and float32 "high"), each in a process of
                 its own: on empty caches, again on the caches the first left, and on
                 empty caches after torch.compiler.load_cache_artifacts of what the first
                 saved, and where the cold and warm first steps' compile time goes
                 (dynamo, AOTAutograd, Inductor's lowering and autotuning, kernel
                 compiles, module loads; all graphs of the process) (~5 min)
  host           the host time of one block's eager fwd+bwd (VisionAttentionBlock against
                 the stock ops of the same parameters, against the attention half of a
                 Hugging Face CLIPEncoderLayer, and under autocast at precision "medium"
                 too), batch 1 8 32, autocast and float32 "high" (~4 min; keep
                 max-autotune: a Gluon choice launches through an operator, a Triton
                 template does not)
  halves         the attention half's GPU time per layer: HF CLIP (--layers) at each
                 --settings, batch 32: stock, swapped and the tower without its attention
                 halves (each layer x + mlp(layer_norm2(x))), eager and compiled; a
                 half's time is (GPU-busy of the tower - GPU-busy of the tower without
                 them) / layers, and the same of the step times (~4 min at 12 layers,
                 one setting)
  module         VisionAttentionBlock at each --precisions against the plain block
                 (LayerNorm, Linear, SDPA, Linear): fwd+bwd ms and MB kept for the
                 backward, then an HF CLIP tower (--layers, default 4) stock against
                 swapped: step ms, MB kept per image, peak MB (--dtype, --autocast,
                 --no-hf; ~2 min)
  accuracy       an HF CLIP tower (--layers, default 4, batch 2) at each --precisions
                 against float64, beside the stock float32 tower's own error, TF32 off
                 (--autocast: stock and swapped under bf16 autocast too; ~1 min)

Per model the tables give the median ms of a training step (forward, backward of a fixed
random gradient of the output into every parameter, zero_grad; inputs at fixed
addresses), the spread (min-max of the timed steps), the first step's seconds (compiles
and autotuning included; our own graphs are cached across models of the same shapes, so
the first model that needs them pays for them), the GPU-busy ms per step (the union of
the kernels' intervals in a torch.profiler trace of 3 steps) and wall / GPU-busy (far
above 1: a host-bound step), the graph breaks torch._dynamo.explain finds, and for
reduce-overhead models the cudagraph skips Inductor logged. Ratios are stock's time over
the swapped one's (above 1: the swap is faster). Everything goes to DIR/SUITE.json (DIR:
--out, else $OUT, else results/; rewritten after each batch or setting, so a call cut
off at its time limit keeps what it measured) and a markdown table printed last. On a
CPU the suites run at a tiny size (a 65-token, 128-wide tower) to check the script.
"""
import argparse
import contextlib
import copy
import functools
import inspect
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness
from harness import compare_times, host_us, step_times

from vitattn_bwd import VisionAttentionBlock, reference, routing
from vitattn_bwd.integrations import swap_attention

SUITES = ("autocast", "float32", "integrations", "head_dims", "deterministic", "restart",
          "host", "halves", "module", "accuracy")
DETERMINISTIC_CUBLAS = ":4096:8"


# ----------------------------------------------------------------------------- towers

def hf_siglip(device, layers):
    """A random-init HF SiglipVisionModel of so400m's shapes (1152 wide, 16 heads of 72,
    384 / 14: 729 tokens) on CUDA; on the CPU 4 heads of 18, 64 tokens."""
    from transformers import SiglipVisionConfig, SiglipVisionModel
    size = (dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16,
                 image_size=384, patch_size=14) if device == "cuda" else
            dict(hidden_size=72, intermediate_size=288, num_attention_heads=4,
                 image_size=64, patch_size=8))
    torch.manual_seed(0)
    config = SiglipVisionConfig(num_hidden_layers=layers, **size)
    return SiglipVisionModel(config).to(device).train()


def hf_clip_of_head_dim(head_dim, hidden_size, intermediate_size):
    """A builder of random-init HF CLIPVisionModels, 224 px in patches of 14 (257
    tokens), 16 heads of head_dim on CUDA (hidden_size wide); on the CPU 4 heads of
    head_dim // 4, 17 tokens."""
    def build(device, layers):
        from transformers import CLIPVisionConfig, CLIPVisionModel
        size = (dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                     num_attention_heads=16, image_size=224, patch_size=14)
                if device == "cuda" else
                dict(hidden_size=head_dim, intermediate_size=2 * head_dim,
                     num_attention_heads=4, image_size=32, patch_size=8))
        torch.manual_seed(0)
        config = CLIPVisionConfig(num_hidden_layers=layers, hidden_act="gelu", **size)
        return CLIPVisionModel(config).to(device).train()
    return build


# OpenCLIP's ViT-H/14 and ViT-bigG/14 (head dims 80 and 104), as HF CLIP towers
HEAD_DIM_TOWERS = (("vit-h/14 shapes", hf_clip_of_head_dim(80, 1280, 5120)),
                   ("vit-bigg/14 shapes", hf_clip_of_head_dim(104, 1664, 8192)))


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


def timm_tower(layers):
    import timm
    return timm.create_model("vit_large_patch14_clip_336", pretrained=False, depth=layers,
                             num_classes=0)


def open_clip_tower(layers):
    from open_clip.transformer import VisionTransformer
    return VisionTransformer(image_size=336, patch_size=14, width=1024, layers=layers,
                             heads=16, mlp_ratio=4.0, output_dim=768)


def timm_vit(device, layers):
    torch.manual_seed(0)
    return timm_tower(layers).to(device).train()


def open_clip_vit(device, layers):
    torch.manual_seed(0)
    return open_clip_tower(layers).to(device).train()


def image_size(model):
    config = getattr(model, "config", None)
    if config is not None:
        return config.image_size
    if hasattr(model, "patch_embed"):                                       # timm
        return model.patch_embed.img_size[0]
    return model.image_size[0]                                              # OpenCLIP


def tower_output(result):
    """The tensor a tower's forward returns: HF's last_hidden_state, or the first of a
    tuple (OpenCLIP with tokens), or the tensor itself (timm's pooled features)."""
    if hasattr(result, "last_hidden_state"):
        return result.last_hidden_state
    return result[0] if isinstance(result, tuple) else result


def is_hf(model):
    return hasattr(getattr(model, "_orig_mod", model), "config")


class MlpHalfOnly(torch.nn.Module):
    """A Hugging Face CLIP-style encoder layer without its attention half:
    x + mlp(layer_norm2(x)), returned as the layer returns its output (a tensor in
    transformers 5, a one-tuple in 4.x, whose layers take output_attentions)."""

    def __init__(self, layer):
        super().__init__()
        self.layer_norm2, self.mlp = layer.layer_norm2, layer.mlp
        self.returns_tuple = "output_attentions" in inspect.signature(
            type(layer).forward).parameters

    def forward(self, hidden_states, *args, **kwargs):
        out = hidden_states + self.mlp(self.layer_norm2(hidden_states))
        return (out,) if self.returns_tuple else out


def encoder_layers(tower):
    """An HF CLIP vision tower's encoder layers (under `vision_model` before
    transformers 5.2x, at the top since)."""
    return getattr(tower, "vision_model", tower).encoder.layers


def without_attention(tower):
    """A copy of an HF CLIP tower whose every encoder layer is MlpHalfOnly."""
    tower = copy.deepcopy(tower)
    layers = encoder_layers(tower)
    for index, layer in enumerate(layers):
        layers[index] = MlpHalfOnly(layer)
    return tower


class HFAttentionHalf(torch.nn.Module):
    """The attention half of a Hugging Face CLIPEncoderLayer as the stock layer runs it:
    x + self_attn(layer_norm1(x)) (separate q, k, v projections, SDPA)."""

    def __init__(self, layer):
        super().__init__()
        self.layer_norm1, self.self_attn = layer.layer_norm1, layer.self_attn

    def forward(self, x):
        return x + self.self_attn(self.layer_norm1(x))[0]


# ------------------------------------------------------------------------ measuring

def autocast_region(device, on):
    return functools.partial(torch.autocast, device, torch.bfloat16, enabled=on)


def train_step(model, pixels, amp, cudagraph_steps=False):
    """One training step of `model` on `pixels`: the forward under `amp`, the backward of
    a fixed random gradient of the output (drawn at the first call), zero_grad first.
    cudagraph_steps: mark each step's start for CUDA graph trees (reduce-overhead)."""
    grad = []
    hf = is_hf(model)

    def step():
        if cudagraph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        with amp():
            out = tower_output(model(pixel_values=pixels) if hf else model(pixels))
        if not grad:
            generator = torch.Generator(out.device).manual_seed(1)
            grad.append(torch.randn(out.shape, generator=generator, device=out.device))
        out.backward(grad[0].to(out.dtype))
    return step


def gpu_busy_ms(step, steps=3):
    """ms per step during which at least one kernel ran (NaN off CUDA)."""
    if not torch.cuda.is_available():
        return float("nan")
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in trace.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e3 / steps


def kernel_ms(step, steps=2):
    """{kernel name: GPU ms per step} from a torch.profiler trace ({} off CUDA)."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals = {}
    for e in trace.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / steps
    return totals


def graph_breaks(model, pixels, amp):
    """torch._dynamo.explain's graph-break count for one forward of `model`."""
    torch._dynamo.reset()
    kwargs = {"pixel_values": pixels} if is_hf(model) else {}
    args = () if kwargs else (pixels,)
    with amp():
        return torch._dynamo.explain(model)(*args, **kwargs).graph_break_count


class CudagraphSkips(logging.Handler):
    """The messages of Inductor's cudagraph-skip log (torch._inductor.cudagraph_utils:
    log_cudagraph_skip_and_bump_counter) while active."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "skipping cudagraphs" in message:
            self.messages.append(message)

    @contextlib.contextmanager
    def capture(self):
        logger = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
        torch._logging.set_logs(cudagraphs=True)
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            torch._logging.set_logs()


def measure(models, pixels, amp, device, rounds, repeats, explain=True):
    """One row per model (name -> model): the step's median, spread, first-step seconds,
    GPU-busy ms, graph breaks and cudagraph skips (reduce-overhead models)."""
    steps = {name: train_step(model, pixels, amp, "reduce-overhead" in name)
             for name, model in models.items()}
    rows = {name: {} for name in models}
    for name, step in steps.items():
        skips = CudagraphSkips()
        before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        with skips.capture() if "reduce-overhead" in name else contextlib.nullcontext():
            rows[name]["first_step_s"] = step_times(step, device, 1)[0] / 1e3
            step()                                        # reduce-overhead records here
        if "reduce-overhead" in name:
            rows[name]["cudagraph_skips"] = (
                torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - before)
            rows[name]["cudagraph_skip_reasons"] = skips.messages[:5]
    times = compare_times(steps, device, rounds, repeats)
    for name, t in times.items():
        busy = gpu_busy_ms(steps[name])
        median = statistics.median(t)
        rows[name].update(median_ms=median, min_ms=min(t), max_ms=max(t), gpu_busy_ms=busy,
                          wall_over_busy=median / busy if busy == busy else float("nan"))
    if explain:                 # an eager model's breaks are its compiled twins' too
        for name, model in models.items():
            if not name.startswith(("compiled", "reduce-overhead")):
                rows[name]["graph_breaks"] = graph_breaks(model, pixels, amp)
        for name in rows:
            eager = name.split(" ", 1)[-1]
            if "graph_breaks" not in rows[name] and eager in rows:
                rows[name]["graph_breaks"] = rows[eager].get("graph_breaks")
    torch._dynamo.reset()
    return rows


def tower_models(stock, compiled=True, reduce_overhead=False, extra=None):
    """name -> model: stock, swapped (precision None), their torch.compile, and
    optionally torch.compile(swapped, mode="reduce-overhead") and `extra` swaps
    (name -> precision)."""
    swapped = swap_attention(copy.deepcopy(stock))
    models = {"stock": stock, "swapped": swapped}
    for name, precision in (extra or {}).items():
        models[name] = swap_attention(copy.deepcopy(stock), precision=precision)
    if compiled:
        models["compiled stock"] = torch.compile(stock, dynamic=False)
        models["compiled swapped"] = torch.compile(swapped, dynamic=False)
    if reduce_overhead:
        models["reduce-overhead swapped"] = torch.compile(swapped, dynamic=False,
                                                          mode="reduce-overhead")
    return models


def ratios(rows):
    """stock / swapped medians: eager, compiled, and compiled stock / swapped eager."""
    def ratio(a, b):
        return rows[a]["median_ms"] / rows[b]["median_ms"] if a in rows and b in rows \
            else None
    return {"eager": ratio("stock", "swapped"),
            "compiled": ratio("compiled stock", "compiled swapped"),
            "compiled stock / swapped eager": ratio("compiled stock", "swapped")}


def pixels_for(model, batch, device):
    size = image_size(model)
    torch.manual_seed(batch)
    return torch.randn(batch, 3, size, size, device=device)


def run_towers(record, tower, setting, batch_sizes, args, device,
               reduce_overhead_batch=None, fields=None):
    """Every model of tower_models at each batch size, each batch's {**fields, setting,
    batch, rows, ratios} added to `record`."""
    for batch in batch_sizes:
        models = tower_models(tower, reduce_overhead=batch == reduce_overhead_batch)
        pixels = pixels_for(tower, batch, device)
        rows = measure(models, pixels, autocast_region(device, setting == "autocast"),
                       device, args.rounds, args.repeats)
        record.add({**(fields or {}), "setting": setting, "batch": batch, "rows": rows,
                    "ratios": ratios(rows)})
        print_rows(f"{setting}, batch {batch}", rows)


# ------------------------------------------------------------------------- suites

def suite_autocast(args, device, record):
    tower = hf_tower(device, args.layers)
    sizes = args.batch_sizes or ([1, 8, 32] if device == "cuda" else [1, 2])
    run_towers(record, tower, "autocast", sizes, args, device,
               reduce_overhead_batch=max(sizes) if device == "cuda" else None)


def suite_float32(args, device, record):
    tower = hf_tower(device, args.layers)
    sizes = args.batch_sizes or ([8, 32] if device == "cuda" else [2])
    for precision in args.float32_precisions:
        torch.set_float32_matmul_precision(precision)
        run_towers(record, tower, f"float32 {precision}", sizes, args, device,
                   reduce_overhead_batch=max(sizes) if device == "cuda" else None)


def suite_integrations(args, device, record):
    """timm and OpenCLIP (4 blocks, batch 32) and SigLIP so400m shapes (6 layers, batch
    16), float32 at the first --float32-precisions and autocast."""
    cuda = device == "cuda"
    towers = (("timm", timm_vit, 4, 32), ("open_clip", open_clip_vit, 4, 32),
              ("siglip so400m", hf_siglip, 6, 16))
    torch.set_float32_matmul_precision(args.float32_precisions[0])
    for library, build, layers, batch in towers:
        try:
            tower = build(device, layers if cuda else 2)
        except ImportError as error:
            print(f"\n{library}: not importable here ({error})", flush=True)
            record.add({"tower": library, "missing": str(error)})
            continue
        for setting in (f"float32 {args.float32_precisions[0]}", "autocast"):
            run_towers(record, tower, setting, [batch if cuda else 2], args, device,
                       fields={"tower": library})
        del tower


def suite_head_dims(args, device, record):
    """HEAD_DIM_TOWERS (6 layers, batch 32), float32 at the first --float32-precisions and
    autocast: the attention core's kernels at head dims that are not powers of two
    (padded tiles)."""
    cuda = device == "cuda"
    torch.set_float32_matmul_precision(args.float32_precisions[0])
    for name, build in HEAD_DIM_TOWERS:
        tower = build(device, 6 if cuda else 1)
        for setting in (f"float32 {args.float32_precisions[0]}", "autocast"):
            run_towers(record, tower, setting, args.batch_sizes or [32 if cuda else 2],
                       args, device, fields={"tower": name})
        del tower


def bitwise_repeat(model, step):
    """Whether two steps on the same inputs give bit-identical gradients: (all equal,
    how many parameter gradients differ)."""
    grads = []
    for _ in range(2):
        step()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    differ = sum(not torch.equal(a, b) for a, b in zip(*grads))
    return differ == 0, differ


@contextlib.contextmanager
def deterministic(on, fill=True):
    """torch.use_deterministic_algorithms(on) and fill_uninitialized_memory=fill inside,
    the process's settings restored after."""
    was, was_fill = torch.are_deterministic_algorithms_enabled(), \
        torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(on)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = was_fill


# the settings of the deterministic, restart, host and halves suites (--settings)
SETTINGS = ("autocast", "float32 high")


def suite_deterministic(args, device, record):
    """Eager stock and swapped towers (and precision "medium", our deterministic
    one-product path, under autocast), without and with the flag.

    What the flag changes (torch 2.13's sources; the guard, the fill and the cache key
    checked on the CPU, the cache key by tests/test_cache.py):
    stock SDPA leaves cuDNN (sdp_utils' check_cudnn_deterministic) for flash's
    deterministic backward; every tensor allocated through the dispatcher (torch.empty,
    new_empty, empty_like, clone, and the outputs that our kernels' launchers, the
    LayerNorm and SDPA kernels allocate) is first filled with NaN
    (torch.utils.deterministic.fill_uninitialized_memory), which Inductor's own buffers
    skip; dynamo's global-state guard fails, so every compiled graph, ours too,
    compiles again, and under another Inductor cache key (which holds the flag and
    fill_uninitialized_memory); Inductor then restricts its reductions' configs and
    materializes some broadcasts. CUBLAS_WORKSPACE_CONFIG=:4096:8 is cuBLAS's default
    on sm90 (32 MiB). The "no NaN fill" row measures the fill's share; the kernel table
    the kernels whose time the flag changed."""
    tower = hf_tower(device, args.layers)
    batch = (args.batch_sizes or ([32] if device == "cuda" else [2]))[0]
    pixels = pixels_for(tower, batch, device)
    torch.set_float32_matmul_precision("high")
    for setting in args.settings:
        amp = autocast_region(device, setting == "autocast")
        extra = {"swapped medium": "medium"} if setting == "autocast" else {}
        models = tower_models(tower, compiled=args.compiled, extra=extra)
        fused = "swapped medium" if setting == "autocast" else "swapped"
        modes = {"flag off": dict(on=False), "flag on": dict(on=True),
                 "flag on, no NaN fill": dict(on=True, fill=False)}
        profiled = [name for name in models if "swapped" in name]      # ours, each
        by_mode, kernels = {}, {name: {} for name in profiled}
        for mode, flags in modes.items():
            with deterministic(**flags):
                chosen = models if mode != "flag on, no NaN fill" else {fused: models[fused]}
                rows = measure(chosen, pixels, amp, device, args.rounds, args.repeats,
                               explain=False)
                for name, model in chosen.items():
                    same, differ = bitwise_repeat(model, train_step(model, pixels, amp))
                    rows[name].update(bitwise_repeat=same, gradients_differing=differ)
                if mode != "flag on, no NaN fill":
                    for name in profiled:
                        kernels[name][mode] = kernel_ms(train_step(models[name], pixels, amp))
            by_mode[mode] = rows
            print_rows(f"{setting}, batch {batch}, {mode}", rows)
        changes = {name: kernel_changes(by_flag["flag off"], by_flag["flag on"])
                   for name, by_flag in kernels.items()}
        record.add({"setting": setting, "batch": batch, "modes": by_mode,
                    "fused_model": fused, "kernel_changes": changes})
        for name, model_changes in changes.items():
            print_kernel_changes(f"{setting}: {name}", model_changes)


def kernel_changes(off, on, top=10):
    """The kernels whose GPU ms per step the flag changed most: [(name, off, on)]."""
    names = set(off) | set(on)
    changes = sorted(names, key=lambda n: -abs(on.get(n, 0.0) - off.get(n, 0.0)))
    return [(n, off.get(n, 0.0), on.get(n, 0.0)) for n in changes[:top]]


RESTART_MODELS = ("compiled stock", "compiled swapped")
# Where a first step's compile time goes (torch._dynamo.utils.compile_times, summed over
# every graph the process compiled, the user's and our own; the phases nest, so they do
# not add up): dynamo's whole compile, its backend (AOTAutograd and Inductor), AOTAutograd,
# Inductor's compile, its lowering, its code generation (where max-autotune's deferred
# choices are benchmarked), the wait for its parallel kernel compiles, loading compiled
# modules. A phase a torch version does not time reads "-".
COMPILE_PHASES = ("_compile.compile_inner", "OutputGraph.call_user_compiler",
                  "create_aot_dispatcher_function", "fx_codegen_and_compile",
                  "GraphLowering.run", "GraphLowering.compile_to_module",
                  "async_compile.wait", "PyCodeCache.load_by_key_path")


def restart_child(args, device):
    """(in a child process) The first step of one compiled model, after CUDA's and
    cuBLAS's own start-up; optionally loading or saving cache artifacts."""
    if args.load_artifacts:
        torch.compiler.load_cache_artifacts(Path(args.load_artifacts).read_bytes())
    setting, model_name = args.restart_setting, args.restart_model
    torch.set_float32_matmul_precision("high")
    tower = hf_tower(device, args.layers)
    if model_name == "compiled swapped":
        tower = swap_attention(tower)
    model = torch.compile(tower, dynamic=False)
    batch = (args.batch_sizes or ([32] if device == "cuda" else [2]))[0]
    pixels = pixels_for(tower, batch, device)
    warm = torch.ones(64, 64, device=device)
    (warm @ warm).sum().item()                         # CUDA context, cuBLAS handle
    step = train_step(model, pixels, autocast_region(device, setting == "autocast"))
    first = step_times(step, device, 1)[0] / 1e3
    counters = torch._dynamo.utils.counters["inductor"]
    if args.save_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(args.save_artifacts).write_bytes(saved[0])
    names, seconds = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    phases = dict(zip(names, map(float, seconds)))
    print(json.dumps({"first_step_s": first, "fxgraph_cache_miss": counters["fxgraph_cache_miss"],
                      "fxgraph_cache_hit": counters["fxgraph_cache_hit"],
                      "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                      "compile_phases_s": {name: phases.get(name)
                                           for name in COMPILE_PHASES}}))


def suite_restart(args, device, record):
    """Each (setting, model) in fresh processes: cold on empty caches (saving the cache
    artifacts), warm on the caches it left, and on empty caches after loading the
    artifacts."""
    with tempfile.TemporaryDirectory() as scratch:
        for setting in args.settings:
            for model_name in RESTART_MODELS:
                tag = f"{setting}-{model_name}".replace(" ", "_")
                caches, fresh = Path(scratch, tag), Path(scratch, tag + "-fresh")
                artifacts = Path(scratch, tag + ".bin")
                row = {"setting": setting, "model": model_name}
                for phase, cache_dir, extra in (
                        ("cold", caches, ["--save-artifacts", str(artifacts)]),
                        ("warm restart", caches, []),
                        ("artifacts restart", fresh, ["--load-artifacts", str(artifacts)])):
                    if phase == "artifacts restart" and not artifacts.exists():
                        row[phase] = {"error": "save_cache_artifacts returned nothing"}
                        continue
                    row[phase] = restart_process(args, setting, model_name, cache_dir, extra)
                record.add(row)
                print(f"\n{setting}, {model_name}: " + json.dumps(row), flush=True)


RESTART_TIMEOUT_S = 240


def restart_process(args, setting, model_name, cache_dir, extra):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("VITATTN_BWD_CACHE", None)
    command = [sys.executable, __file__, "--suite", "restart", "--restart-child",
               "--restart-setting", setting, "--restart-model", model_name,
               "--layers", str(args.layers),
               "--our-attention-from", str(args.our_attention_from), *extra]
    if args.batch_sizes:
        command += ["--batch-sizes", *map(str, args.batch_sizes)]
    start = time.perf_counter()
    try:
        # a cold max-autotune first step of a 12-layer tower took 19-38 s on the H200
        run = subprocess.run(command, capture_output=True, text=True, env=env,
                             timeout=RESTART_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no first step within {RESTART_TIMEOUT_S} s"}
    if run.returncode:
        return {"error": run.stderr[-2000:]}
    return {**json.loads(run.stdout.strip().splitlines()[-1]),
            "process_s": time.perf_counter() - start}


def host_time_us(step, calls, cuda):
    """Host µs per call of step(): harness.host_us on CUDA (the GPU kept busy ahead
    of the calls); on the CPU, where host and device are one, the time per call after 3
    calls that compile and warm up."""
    if cuda:
        return host_us(step, calls)
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls * 1e6


def suite_host(args, device, record):
    """Host µs per eager fwd+bwd of one block, ours against the stock block (the GPU kept
    busy ahead of the calls, so no call waits for it; harness.host_us)."""
    cuda = device == "cuda"
    seq_len, embed_dim, heads = (577, 1024, 16) if cuda else (65, 128, 4)
    torch.set_float32_matmul_precision("high")
    hf_layer = encoder_layers(hf_tower(device, 1))[0]         # E, heads as above
    for setting in args.settings:
        amp = autocast_region(device, setting == "autocast")
        for batch in args.batch_sizes or ([1, 8, 32] if cuda else [1, 2]):
            torch.manual_seed(0)
            block = VisionAttentionBlock(embed_dim, heads).to(device)
            blocks = {"stock": reference.ReferenceBlock(block), "swapped": block,
                      "hf stock": HFAttentionHalf(hf_layer)}
            if setting == "autocast":            # our one-product path, as "medium" runs it
                medium = VisionAttentionBlock(embed_dim, heads, precision="medium")
                medium.load_state_dict(block.state_dict())
                blocks["swapped medium"] = medium.to(device)
            x = torch.randn(batch, seq_len, embed_dim, device=device, requires_grad=True)
            grad = torch.randn_like(x)
            host = {}
            for name, model in blocks.items():
                def step(model=model):
                    with amp():
                        y = model(x)
                    y.backward(grad.to(y.dtype))
                host[name] = statistics.median(host_time_us(step, args.repeats * 5, cuda)
                                               for _ in range(args.rounds))
            result = {"setting": setting, "batch": batch, "host_us": host,
                      "stock_over_swapped": host["stock"] / host["swapped"],
                      "hf_stock_over_swapped": host["hf stock"] / host["swapped"]}
            if "swapped medium" in host:
                result["stock_over_medium"] = host["stock"] / host["swapped medium"]
            record.add(result)
            print(f"{setting}, batch {batch}: host us {host}", flush=True)


def suite_halves(args, device, record):
    """Per setting: stock, swapped and the tower without attention halves, eager and
    compiled, at one batch; each tower's attention half per layer against the tower
    without them in the same mode."""
    tower = hf_tower(device, args.layers)
    batch = (args.batch_sizes or [32 if device == "cuda" else 2])[0]
    for setting in args.settings:
        if setting != "autocast":
            torch.set_float32_matmul_precision(setting.split()[-1])
        models = tower_models(tower)
        bare = without_attention(tower)
        models["without attention"] = bare
        models["compiled without attention"] = torch.compile(bare, dynamic=False)
        pixels = pixels_for(tower, batch, device)
        rows = measure(models, pixels, autocast_region(device, setting == "autocast"),
                       device, args.rounds, args.repeats, explain=False)
        halves = {}
        for name in ("stock", "swapped", "compiled stock", "compiled swapped"):
            without = ("compiled " if name.startswith("compiled") else "") \
                + "without attention"
            halves[name] = {
                "without": without,
                "per_layer_ms": (rows[name]["gpu_busy_ms"]
                                 - rows[without]["gpu_busy_ms"]) / args.layers,
                "per_layer_step_ms": (rows[name]["median_ms"]
                                      - rows[without]["median_ms"]) / args.layers}
        record.add({"setting": setting, "batch": batch, "layers": args.layers,
                    "rows": rows, "attention_half_ms": halves})
        print_rows(f"{setting}, batch {batch}", rows)


def _block_step(model, x, grad, amp):
    with amp():
        y = model(x)
    y.backward(grad.to(y.dtype))


def saved_mb(model, x, device, amp):
    """MB a block's forward keeps for its backward (NaN off CUDA)."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with amp():
        y = model(x)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept / 2 ** 20


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


def suite_module(args, device, record):
    """VisionAttentionBlock at each --precisions ("default": precision None) against the
    plain block (LayerNorm, Linear, SDPA, Linear): fwd+bwd ms and MB kept for the
    backward; then (unless --no-hf) the HF CLIP tower (--layers, default 4) stock against
    swapped (precision None): step ms, MB kept per image, peak MB. --dtype: bf16 / fp16
    parameters and inputs (the native path); --autocast: forwards under bf16 autocast.
    TF32 as the process has it (off by default). Median of 5 rounds of 10 steps per model,
    the models taking turns (harness.compare_times' defaults, as bench_module.py ran)."""
    dtype = getattr(torch, args.dtype)
    seq_len, embed_dim, heads = (577, 1024, 16) if device == "cuda" else (65, 128, 4)
    sizes = args.batch_sizes or ((1, 8, 32) if device == "cuda" else (1, 4))
    amp = (functools.partial(torch.autocast, device, torch.bfloat16) if args.autocast
           else contextlib.nullcontext)
    precisions = args.precisions or (("default", "high")
                                     if args.autocast or dtype != torch.float32
                                     else ("highest", "high"))
    setting = args.dtype + (", autocast" if args.autocast else "")
    torch.manual_seed(0)
    block = VisionAttentionBlock(embed_dim, heads).to(device, dtype)
    models = {}
    for precision in precisions:
        model = VisionAttentionBlock(embed_dim, heads,
                                     precision=None if precision == "default" else precision)
        model.load_state_dict(block.state_dict())
        models[f"vitattn {precision}"] = model.to(device, dtype)
    models["plain_sdpa"] = reference.ReferenceBlock(block)
    for batch in sizes:
        x = torch.randn(batch, seq_len, embed_dim, device=device, dtype=dtype,
                        requires_grad=True)
        grad = torch.randn_like(x)
        times = compare_times({name: functools.partial(_block_step, model, x, grad, amp)
                               for name, model in models.items()}, device)
        record.add({"model": "block", "setting": setting, "batch": batch, "rows": {
            name: {"median_ms": statistics.median(times[name]),
                   "kept_mb": saved_mb(model, x, device, amp)}
            for name, model in models.items()}})
    if args.no_hf:
        return
    try:
        stock = hf_tower(device, args.layers).to(dtype)
    except ImportError as error:
        record.add({"model": "hf clip", "missing": str(error)})
        return
    ours = swap_attention(copy.deepcopy(stock))
    c = stock.config
    tokens = (c.image_size // c.patch_size) ** 2 + 1
    for batch in sizes:
        pixels = torch.randn(batch, 3, c.image_size, c.image_size, device=device, dtype=dtype)
        grad = torch.randn(batch, tokens, c.hidden_size, device=device, dtype=dtype)
        times = compare_times({"stock": hf_step(stock, pixels, grad, amp),
                               "swapped": hf_step(ours, pixels, grad, amp)}, device)
        rows = {}
        for name, model in (("stock", stock), ("swapped", ours)):
            kept, peak = hf_memory_mb(model, pixels, grad, device, amp)
            rows[name] = {"median_ms": statistics.median(times[name]),
                          "kept_mb_per_image": kept, "peak_mb": peak}
        record.add({"model": f"hf clip, {args.layers} layers", "setting": setting,
                    "batch": batch, "rows": rows})


def accuracy_tower(device, layers):
    """hf_tower in eval mode with its LayerNorm parameters (and every other 1-d one)
    moved off 1 and 0."""
    model = hf_tower(device, layers).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def hidden_and_grads(model, pixels, weight, autocast=False):
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    region = (torch.autocast(pixels.device.type, torch.bfloat16) if autocast
              else contextlib.nullcontext())
    with region:
        out = model(pixel_values=pixels.to(dtype))
    ((out.last_hidden_state * weight.to(dtype)).sum() + out.pooler_output.pow(2).sum()
     ).backward()
    return out.last_hidden_state.detach(), {n: p.grad.detach().clone()
                                           for n, p in model.named_parameters()}


def errors_against(hidden, grads, hidden64, grads64):
    """Relative errors of the output and of every gradient against float64 (k_proj.bias,
    zero in exact math, against its layer's q/k/v bias gradients)."""
    result = {"last_hidden_state": ((hidden.double() - hidden64).norm()
                                    / hidden64.norm()).item()}
    for name, g in grads.items():
        denom = grads64[name].norm()
        if name.endswith("k_proj.bias"):
            layer = name[:-len("k_proj.bias")]
            denom = torch.cat([grads64[layer + p + "_proj.bias"] for p in "qkv"]).norm()
        result[name] = ((g.double() - grads64[name]).norm() / denom).item()
    return result


def suite_accuracy(args, device, record):
    """How close each --precisions of the swapped tower comes to float64, against the
    stock float32 tower's own error: HF CLIP (--layers, default 4), batch the first of
    --batch-sizes (default 2), one forward and backward of a weighted-sum loss, TF32 off.
    Per row: the output's error and the largest ratio of a gradient's error to the stock
    row's (issue 24's yardstick: "highest" within 10x). --autocast adds stock and swapped
    (precision None) under bf16 autocast, the swapped against the stock under autocast."""
    torch.backends.cuda.matmul.allow_tf32 = False       # a script: its own process
    torch.backends.cudnn.allow_tf32 = False
    stock = accuracy_tower(device, args.layers)
    batch = (args.batch_sizes or [2])[0]
    c = stock.config
    tokens = (c.image_size // c.patch_size) ** 2 + 1
    g = torch.Generator(device=device).manual_seed(1)
    pixels = torch.randn(batch, 3, c.image_size, c.image_size, device=device, generator=g)
    weight = torch.randn(batch, tokens, c.hidden_size, device=device, generator=g)
    hidden64, grads64 = hidden_and_grads(copy.deepcopy(stock).double(), pixels,
                                         weight.double())
    table = {"stock float32": errors_against(*hidden_and_grads(stock, pixels, weight),
                                             hidden64, grads64)}
    for precision in args.precisions or ("highest", "high"):
        ours = swap_attention(copy.deepcopy(stock), precision=precision)
        table[precision] = errors_against(*hidden_and_grads(ours, pixels, weight),
                                          hidden64, grads64)
    baseline = dict.fromkeys(table, "stock float32")      # each row against its own stock
    if args.autocast:
        table["stock bf16 autocast"] = errors_against(
            *hidden_and_grads(stock, pixels, weight, autocast=True), hidden64, grads64)
        table["ours bf16 autocast"] = errors_against(
            *hidden_and_grads(swap_attention(copy.deepcopy(stock)), pixels, weight,
                              autocast=True), hidden64, grads64)
        baseline.update({"stock bf16 autocast": "stock float32",
                         "ours bf16 autocast": "stock bf16 autocast"})
    for row, errs in table.items():
        stock_errors = table[baseline[row]]
        ratios_ = {n: errs[n] / stock_errors[n] for n in errs if n != "last_hidden_state"}
        worst = sorted(ratios_, key=ratios_.get, reverse=True)[:3]
        record.add({"precision": row, "batch": batch, "baseline": baseline[row],
                    "output_error": errs["last_hidden_state"],
                    "output_over_stock": (errs["last_hidden_state"]
                                          / stock_errors["last_hidden_state"]),
                    "worst_grad_over_stock": ratios_[worst[0]],
                    "worst": [(n, errs[n], stock_errors[n]) for n in worst],
                    "errors": errs})


SUITE_FUNCTIONS = {"autocast": suite_autocast, "float32": suite_float32,
                   "integrations": suite_integrations, "head_dims": suite_head_dims,
                   "deterministic": suite_deterministic,
                   "restart": suite_restart, "host": suite_host, "halves": suite_halves,
                   "module": suite_module, "accuracy": suite_accuracy}


# ------------------------------------------------------------------------- tables

def cell(value, fmt="{:.2f}"):
    if value is None or value != value:
        return "-"
    return fmt.format(value) if isinstance(value, float) else str(value)


def print_rows(title, rows):
    print(f"\n| {title} | median ms | spread ms | first step s | GPU-busy ms | wall/busy | "
          "graph breaks | cudagraph skips | bitwise repeat |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {cell(r.get('median_ms'))} | {cell(r.get('min_ms'))}-"
              f"{cell(r.get('max_ms'))} | {cell(r.get('first_step_s'), '{:.1f}')} | "
              f"{cell(r.get('gpu_busy_ms'))} | {cell(r.get('wall_over_busy'))} | "
              f"{cell(r.get('graph_breaks'))} | {cell(r.get('cudagraph_skips'))} | "
              f"{cell(r.get('bitwise_repeat'))} |", flush=True)
        for reason in r.get("cudagraph_skip_reasons", ()):
            print(f"  cudagraph log: {reason}")


def print_kernel_changes(title, changes):
    print(f"\n| {title}: kernel | ms/step flag off | ms/step flag on |\n|---|---|---|")
    for name, off, on in changes:
        print(f"| {name[:90]} | {off:.3f} | {on:.3f} |")


def summary(suite, results):
    """The suite's closing table (printed last)."""
    lines = []
    if suite in ("autocast", "float32", "integrations", "head_dims"):
        lines += ["| tower | setting | batch | stock ms | swapped ms | compiled stock ms | "
                  "compiled swapped ms | eager ratio | compiled ratio | "
                  "compiled stock / swapped eager | compiled swapped wall/busy | "
                  "graph breaks stock / swapped | reduce-overhead swapped ms (skips) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            if "missing" in r:
                lines.append(f"| {r['tower']} | not importable: {r['missing']} |")
                continue
            rows, q = r["rows"], r["ratios"]
            ms = [cell(rows.get(n, {}).get("median_ms")) for n in
                  ("stock", "swapped", "compiled stock", "compiled swapped")]
            lines.append(f"| {r.get('tower', 'hf clip')} | {r['setting']} | {r['batch']} | "
                         + " | ".join(ms) + " | " + " | ".join(
                             cell(q[k], "{:.2f}x") for k in q) + " | "
                         + cell(rows.get("compiled swapped", {}).get("wall_over_busy"))
                         + f" | {cell(rows['stock'].get('graph_breaks'))} / "
                         f"{cell(rows['swapped'].get('graph_breaks'))} | "
                         + reduce_overhead_cell(rows) + " |")
    elif suite == "deterministic":
        lines += ["| setting | model | flag off ms | flag on ms | on / off | bitwise off / on |",
                  "|---|---|---|---|---|---|"]
        for r in results:
            off, on = r["modes"]["flag off"], r["modes"]["flag on"]
            for name in off:
                lines.append(f"| {r['setting']} | {name} | {cell(off[name]['median_ms'])} | "
                             f"{cell(on[name]['median_ms'])} | "
                             f"{on[name]['median_ms'] / off[name]['median_ms']:.3f} | "
                             f"{off[name]['bitwise_repeat']} / {on[name]['bitwise_repeat']} |")
            nofill = r["modes"]["flag on, no NaN fill"][r["fused_model"]]["median_ms"]
            lines.append(f"| {r['setting']} | {r['fused_model']}, flag on, no NaN fill | | "
                         f"{nofill:.2f} | {nofill / off[r['fused_model']]['median_ms']:.3f} "
                         "| |")
    elif suite == "restart":
        lines += ["| setting | model | cold first step s | warm restart s | "
                  "artifacts restart s | cache hits warm |", "|---|---|---|---|---|---|"]
        for r in results:
            s = [cell(r[p].get("first_step_s")) for p in
                 ("cold", "warm restart", "artifacts restart")]
            lines.append(f"| {r['setting']} | {r['model']} | " + " | ".join(s) + " | "
                         f"{cell(r['warm restart'].get('fxgraph_cache_hit'))} |")
        lines += ["", "| setting | model | run | graphs | "
                  + " | ".join(COMPILE_PHASES) + " |", "|---" * (4 + len(COMPILE_PHASES)) + "|"]
        for r in results:
            for run in ("cold", "warm restart"):
                spent = r[run].get("compile_phases_s", {})
                lines.append(f"| {r['setting']} | {r['model']} | {run} | "
                             f"{cell(r[run].get('graphs'))} | "
                             + " | ".join(cell(spent.get(name)) for name in COMPILE_PHASES)
                             + " |")
    elif suite == "host":
        lines += ["| setting | batch | stock host us | swapped host us | stock / swapped | "
                  "HF stock half host us | HF stock / swapped | swapped medium host us | "
                  "stock / medium |", "|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            medium = r["host_us"].get("swapped medium")
            lines.append(f"| {r['setting']} | {r['batch']} | {r['host_us']['stock']:.0f} | "
                         f"{r['host_us']['swapped']:.0f} | {r['stock_over_swapped']:.2f}x | "
                         f"{r['host_us']['hf stock']:.0f} | "
                         f"{r['hf_stock_over_swapped']:.2f}x | "
                         f"{cell(medium, '{:.0f}')} | "
                         f"{cell(r.get('stock_over_medium'), '{:.2f}x')} |")
    elif suite == "halves":
        lines += ["| setting | batch | model | GPU-busy ms | without attention | "
                  "attention half per layer, GPU-busy ms | by step time ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in results:
            for name, half in r["attention_half_ms"].items():
                lines.append(f"| {r['setting']} | {r['batch']} | {name} | "
                             f"{cell(r['rows'][name]['gpu_busy_ms'])} | "
                             f"{cell(r['rows'][half['without']]['gpu_busy_ms'])} | "
                             f"{cell(half['per_layer_ms'], '{:.3f}')} | "
                             f"{cell(half['per_layer_step_ms'], '{:.3f}')} |")
    elif suite == "module":
        lines += ["| what | setting | batch | model | median ms | kept MB | "
                  "kept MB/image | peak MB |", "|---|---|---|---|---|---|---|---|"]
        for r in results:
            if "missing" in r:
                lines.append(f"| {r['model']} | not importable: {r['missing']} |")
                continue
            for name, row in r["rows"].items():
                lines.append(f"| {r['model']} | {r['setting']} | {r['batch']} | {name} | "
                             f"{cell(row['median_ms'], '{:.3f}')} | "
                             f"{cell(row.get('kept_mb'), '{:.0f}')} | "
                             f"{cell(row.get('kept_mb_per_image'), '{:.1f}')} | "
                             f"{cell(row.get('peak_mb'), '{:.0f}')} |")
    elif suite == "accuracy":
        lines += ["| precision | output error | output / stock | worst gradient / stock | "
                  "worst gradients (ours / stock; stock: that row's baseline) |",
                  "|---|---|---|---|---|"]
        for r in results:
            detail = ", ".join(f"{n} {e:.1e}/{b:.1e}" for n, e, b in r["worst"])
            lines.append(f"| {r['precision']} | {r['output_error']:.2e} | "
                         f"{r['output_over_stock']:.1f} | {r['worst_grad_over_stock']:.1f} | "
                         f"{detail} |")
    return "\n".join(lines)


def reduce_overhead_cell(rows):
    row = rows.get("reduce-overhead swapped")
    if row is None:
        return "-"
    return f"{cell(row['median_ms'])} ({row['cudagraph_skips']})"


class Record:
    """A suite's results, written to `path` as JSON ({**header, "results": [...]}) at
    every add, so that a device call cut off at its time limit still leaves what it
    measured."""

    def __init__(self, path, header):
        self.path, self.header, self.results = Path(path), header, []
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, result):
        self.results.append(result)
        self.path.write_text(json.dumps({**self.header, "results": self.results}, indent=1,
                                        default=str))


def results_rows(suite, results, command):
    """The results file's rows of a suite: each model's median step ms per setting and
    batch (harness.append_results)."""
    rows = []
    for r in results:
        for name, row in (r.get("rows") or {}).items():
            if isinstance(row, dict) and row.get("median_ms") is not None:
                tower = r.get("tower") or r.get("model") or "hf clip"
                rows.append(dict(what=f"{suite} suite: {tower}, {name}", batch=r.get("batch"),
                                 setting=r.get("setting", ""),
                                 figure=f"{row['median_ms']:.6g}", unit="ms",
                                 command=command))
    return rows


def environment():
    import triton
    return {"torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "compile_mode": os.environ.get("VITATTN_BWD_COMPILE_MODE", "max-autotune"),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", required=True, choices=SUITES)
    parser.add_argument("--layers", type=int, help="HF CLIP layers (default: 12 on "
                        "CUDA, 4 in the module and accuracy suites; 2 on the CPU)")
    parser.add_argument("--batch-sizes", type=int, nargs="+",
                        help="default: the suite's (module docstring)")
    parser.add_argument("--float32-precisions", nargs="+", default=["high", "highest"],
                        choices=("highest", "high"), help="default: %(default)s "
                        "(integrations: the first only)")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="deterministic, restart, host and halves suites: the settings "
                        "to run (default: both)")
    parser.add_argument("--compiled", action="store_true", help="deterministic suite: "
                        "torch.compile(stock) and torch.compile(swapped) too (+~3 min)")
    parser.add_argument("--precisions", nargs="+",
                        choices=("default", "highest", "high", "medium"),
                        help="module and accuracy suites: the blocks' precisions "
                        "(\"default\": None; default: highest high, and with --autocast or "
                        "a half --dtype in the module suite: default high)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16",
                                                               "float16"),
                        help="module suite: the parameters' and inputs' dtype")
    parser.add_argument("--autocast", action="store_true", help="module and accuracy "
                        "suites: forwards under torch.autocast(bfloat16)")
    parser.add_argument("--no-hf", action="store_true",
                        help="module suite: the block only, no Hugging Face tower")
    parser.add_argument("--rounds", type=int, default=3, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    parser.add_argument("--out", type=Path, help="default: $OUT, else results/")
    parser.add_argument("--no-record", action="store_true", help="do not append the "
                        "step times to results/runs.csv (a CPU run never does)")
    parser.add_argument("--our-attention-from", type=int,
                        default=routing.OUR_ATTENTION_MIN_BATCH,
                        help="routing.OUR_ATTENTION_MIN_BATCH for the run: the swapped "
                        "towers' stock route takes our attention from this batch on "
                        "(default: %(default)s)")
    # the restart suite's child processes
    parser.add_argument("--restart-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--restart-setting", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--restart-model", choices=RESTART_MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--save-artifacts", help=argparse.SUPPRESS)
    parser.add_argument("--load-artifacts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    routing.OUR_ATTENTION_MIN_BATCH = args.our_attention_from
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small_tower = args.suite in ("module", "accuracy")
    args.layers = args.layers or (2 if device != "cuda" else 4 if small_tower else 12)
    if args.suite == "deterministic":
        # read by cuBLAS when its first handle is made, so before any CUDA work
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS
    if args.restart_child:
        return restart_child(args, device)
    out = args.out or Path(os.environ.get("OUT") or "results")
    record = Record(out / f"{args.suite}.json", {"suite": args.suite, "layers": args.layers,
                                                 "environment": environment()})
    SUITE_FUNCTIONS[args.suite](args, device, record)
    if device == "cuda" and not args.no_record:
        harness.append_results(results_rows(args.suite, record.results, " ".join(
            ["python3 scripts/bench_towers.py", *(argv or sys.argv[1:])])))
    print(f"\n{args.suite}: {json.dumps(environment())}; {record.path}")
    print(summary(args.suite, record.results))


if __name__ == "__main__":
    main()
