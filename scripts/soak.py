"""Training soak: a Hugging Face CLIP vision tower (transformers CLIPVisionModel, random
init, ViT-L/14-336 shapes, 4 layers) with its attention swapped for vitattn_bwd's block,
against the stock tower from the same initial weights on the same data, N AdamW steps
each, under bf16 autocast and in float32 (TF32 off). Beside them the stock tower from
--spread-seeds other seeds (initial weights and data), whose largest distance from the
first stock run is the run-to-run spread the swapped run's distance is measured against;
the stock tower once more from the first seed (its distance from the first stock run:
how far the training's own rounding noise carries two runs of the same model apart,
zero where stock repeats bit for bit); and the swapped run once more, for bitwise
reproducibility.

    PYTHONPATH=. python3 scripts/soak.py --steps 500 --out $OUT/soak     # on the GPU
    PYTHONPATH=. python3 scripts/soak.py --tiny --steps 3 --out /tmp/soak  # CPU, tiny tower

Recorded per run: the loss per step, the steps with a non-finite loss or gradient, the
device memory allocated after each step (and its peak within the step), step times;
per setting: the largest |swapped - stock|, |other seed - stock| (the largest over the
other seeds) and |stock again - stock| over the smoothed loss curves, whether the
swapped run repeated bit for bit (losses and final weights), and memory growth after
the first steps. Writes soak.json and, where matplotlib
imports, soak.png into --out; prints a summary table last.

Precisions: under autocast the swapped tower runs `--autocast-precision` (default
"medium": our one-product bf16 path; precision None would run the stock ops there,
routing.py), in float32 `--float32-precision` (default None: torch's float32 matmul
precision, "highest" with TF32 off: the split GEMMs). The loss: mean squared distance
of the last hidden state from a random target plus the pooled output's mean square
(positive, O(1)), over a data set of DATA_BATCHES random batches seen in turn. cuDNN runs deterministically (set per run and restored), so that the
stock parts of the swapped tower (the patch convolution) do not break its
reproducibility.
"""
import argparse
import contextlib
import copy
import hashlib
import json
import time
from pathlib import Path

import torch

SMOOTHING = 20          # steps in the moving average of the loss curves compared
FLAT_AFTER = 5          # memory is compared from this step on
DATA_BATCHES = 8        # the data set: this many batches, seen in turn (a tower can fit
                        # them, so the loss falls; a new random target every step would
                        # only make the weights wander)


def tower_config(tiny, layers):
    """CLIPVisionConfig at ViT-L/14-336 shapes (577 tokens, 1024 wide, 16 heads), or a
    tiny one for the CPU (17 tokens, 64 wide, 4 heads)."""
    import transformers
    if tiny:
        sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     image_size=56, patch_size=14)
    else:
        sizes = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                     image_size=336, patch_size=14)
    return transformers.CLIPVisionConfig(num_hidden_layers=layers, hidden_act="quick_gelu",
                                         **sizes)


def stock_tower(config, seed, device):
    import transformers
    torch.manual_seed(seed)
    return transformers.CLIPVisionModel(config).to(device)


def swapped_tower(stock, precision):
    from vitattn_bwd.integrations.hf import swap_attention
    return swap_attention(copy.deepcopy(stock), precision=precision)


def batch_of(config, batch, seed, index, device):
    """Pixels [B,3,I,I] and the target [B,S,E] of batch `index` of the data set of `seed`:
    the same for every run with that seed."""
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
    size, tokens = config.image_size, (config.image_size // config.patch_size) ** 2 + 1
    pixels = torch.randn(batch, 3, size, size, device=device, generator=generator)
    target = torch.randn(batch, tokens, config.hidden_size, device=device,
                         generator=generator)
    return pixels, target


def loss_of(model, pixels, target):
    out = model(pixel_values=pixels)
    return (((out.last_hidden_state.float() - target) ** 2).mean()
            + out.pooler_output.float().pow(2).mean())


@contextlib.contextmanager
def numerics(setting):
    """TF32 off and cuDNN deterministic for one run, restored after; bf16 autocast for
    the "bf16" setting."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved


def weights_digest(model):
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def train(model, config, setting, *, steps, batch, data_seed, lr, device):
    """`steps` AdamW steps over the DATA_BATCHES batches of data_seed in turn; the run's
    record (losses, non-finite steps, memory, times)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    on_cuda = device == "cuda"
    autocast = (torch.autocast(device, dtype=torch.bfloat16) if setting == "bf16"
                else contextlib.nullcontext())
    record = dict(losses=[], non_finite_steps=[], memory_mb=[], peak_memory_mb=[],
                  step_s=[])
    model.train()
    with numerics(setting):
        for step in range(steps):
            pixels, target = batch_of(config, batch, data_seed, step % DATA_BATCHES, device)
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_of(model, pixels, target)
            loss.backward()
            finite = torch.isfinite(loss) & torch.stack(
                [torch.isfinite(p.grad).all() for p in model.parameters()
                 if p.grad is not None]).all()
            optimizer.step()
            record["losses"].append(loss.item())          # synchronizes
            record["step_s"].append(time.perf_counter() - start)
            if not finite.item():
                record["non_finite_steps"].append(step)
            if on_cuda:
                record["memory_mb"].append(torch.cuda.memory_allocated() / 2 ** 20)
                record["peak_memory_mb"].append(torch.cuda.max_memory_allocated() / 2 ** 20)
    record["weights_sha256"] = weights_digest(model)
    return record


def smoothed(values, window=SMOOTHING):
    """Moving averages over `window` steps (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def largest_gap(a, b):
    return max(abs(x - y) for x, y in zip(smoothed(a), smoothed(b)))


def memory_growth_mb(record):
    """Allocated memory after the last step minus after step FLAT_AFTER (0 on the CPU)."""
    memory = record["memory_mb"]
    return memory[-1] - memory[min(FLAT_AFTER, len(memory) - 1)] if memory else 0.0


def soak_setting(setting, precision, *, tiny, layers, steps, batch, lr, seed, spread_seeds,
                 device):
    """The runs of one setting ("bf16" or "float32") and their comparison."""
    config = tower_config(tiny, layers)
    runs = {}
    stock = stock_tower(config, seed, device)
    initial = copy.deepcopy(stock.state_dict())
    kwargs = dict(steps=steps, batch=batch, lr=lr, device=device)
    for name in ("swapped", "swapped again"):
        stock.load_state_dict(initial)
        runs[name] = train(swapped_tower(stock, precision), config, setting,
                           data_seed=seed, **kwargs)
    for name in ("stock", "stock again"):
        stock.load_state_dict(initial)
        runs[name] = train(stock, config, setting, data_seed=seed, **kwargs)
    other_seeds = {f"stock, seed {other}": other
                   for other in range(seed + 1, seed + 1 + spread_seeds)}
    for name, other in other_seeds.items():
        runs[name] = train(stock_tower(config, other, device), config, setting,
                           data_seed=other, **kwargs)
    first, again = runs["swapped"], runs["swapped again"]
    stock_losses = runs["stock"]["losses"]
    spreads = {name: largest_gap(runs[name]["losses"], stock_losses) for name in other_seeds}
    summary = dict(
        precision=precision,
        swapped_vs_stock=largest_gap(first["losses"], stock_losses),
        run_to_run_spread=max(spreads.values()),
        spread_per_seed=spreads,
        stock_again_vs_stock=largest_gap(runs["stock again"]["losses"], stock_losses),
        bitwise_reproducible=(first["losses"] == again["losses"]
                              and first["weights_sha256"] == again["weights_sha256"]),
        non_finite_steps={name: run["non_finite_steps"] for name, run in runs.items()},
        memory_growth_mb={name: memory_growth_mb(run) for name, run in runs.items()},
        median_step_ms={name: 1e3 * sorted(run["step_s"])[len(run["step_s"]) // 2]
                        for name, run in runs.items()})
    return dict(summary=summary, runs=runs)


def plot(results, path):
    """Loss curves (smoothed) per setting, and |swapped - stock| against the spread."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return False
    figure, axes = pyplot.subplots(2, len(results), figsize=(6 * len(results), 7),
                                   squeeze=False)
    for column, (setting, result) in enumerate(results.items()):
        runs = result["runs"]
        for name, run in runs.items():
            axes[0][column].plot(smoothed(run["losses"]), label=name)
        axes[0][column].set_title(f"{setting}: loss ({SMOOTHING}-step average)")
        axes[0][column].legend()
        stock = smoothed(runs["stock"]["losses"])
        others = [name for name in runs if name.startswith("stock, seed")]
        for name in ["swapped", "stock again", *others]:
            gaps = [abs(a - b) for a, b in zip(smoothed(runs[name]["losses"]), stock)]
            axes[1][column].semilogy([max(g, 1e-12) for g in gaps], label=f"|{name} - stock|")
        axes[1][column].set_xlabel("AdamW step")
        axes[1][column].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def parse_precision(text):
    return None if text == "none" else text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spread-seeds", type=int, default=3,
                        help="stock runs from other seeds; the spread is the largest gap")
    parser.add_argument("--settings", default="bf16,float32",
                        help="comma-separated: bf16 (autocast), float32")
    parser.add_argument("--autocast-precision", type=parse_precision, default="medium",
                        help="the swapped tower's precision under autocast (none: None)")
    parser.add_argument("--float32-precision", type=parse_precision, default=None,
                        help="the swapped tower's precision in float32 (none: None)")
    parser.add_argument("--tiny", action="store_true", help="a tiny tower (CPU check)")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for setting in args.settings.split(","):
        precision = args.autocast_precision if setting == "bf16" else args.float32_precision
        results[setting] = soak_setting(setting, precision, tiny=args.tiny,
                                        layers=args.layers, steps=args.steps,
                                        batch=args.batch, lr=args.lr, seed=args.seed,
                                        spread_seeds=args.spread_seeds, device=device)
    report = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, arguments={k: str(v) for k, v in vars(args).items()},
                  results=results)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    plotted = plot(results, args.out / "soak.png")
    print(f"{'setting':8} {'precision':9} {'|swapped-stock|':>16} {'spread':>10} "
          f"{'|stock again-stock|':>20} {'bitwise':>8} {'NaN steps':>9} "
          f"{'mem growth MB':>13} {'ms/step swapped/stock':>22}")
    for setting, result in results.items():
        s = result["summary"]
        nan_steps = sum(len(v) for v in s["non_finite_steps"].values())
        growth = max(s["memory_growth_mb"].values())
        times = s["median_step_ms"]
        print(f"{setting:8} {str(s['precision']):9} {s['swapped_vs_stock']:16.3e} "
              f"{s['run_to_run_spread']:10.3e} {s['stock_again_vs_stock']:20.3e} "
              f"{str(s['bitwise_reproducible']):>8} "
              f"{nan_steps:9d} {growth:13.1f} "
              f"{times['swapped']:10.1f} / {times['stock']:.1f}")
    print(f"wrote {args.out / 'soak.json'}" + (f" and {args.out / 'soak.png'}" if plotted else
                                              " (no matplotlib: no plot)"))
    return report


if __name__ == "__main__":
    main()
