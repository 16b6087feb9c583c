"""What the scripts share: inputs, the float64 check, the L2 flush, the benchmark
harness's way of timing a call, step timing, and the results file.

    import harness        # from a script run as `python3 scripts/x.py`

- module_step(batch, autocast, stock): one VisionAttentionBlock fwd+bwd step.
- bench_ms(fn): median ms of triton.testing.do_bench (the L2 flushed before each run).
- host_us(step, calls): host time per call with the GPU kept busy.
- harness_times(fn, args): the contract harness's span of a call (inputs at fresh
  addresses, the L2 flushed, first kernel's start to last kernel's end), with its GPU
  busy, copy and event times and kernel count; host_ms_per_call beside it.
- step_times / compare_times: wall ms of training steps, the steps taking turns.
- contract_margins(batch): the entry point against the float64 reference, per output.
- append_results(rows): one row per measurement appended to results/runs.csv, the file
  docs/performance.md's tables are made from (contract_rows: bench.py's rows as such;
  plot_results draws the file).
"""
import contextlib
import csv
import datetime
import math
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

from vitattn_bwd import VisionAttentionBlock, attention_block_backward, reference
from vitattn_bwd.precision import split_bf16_rounded
from vitattn_bwd.workloads import NUM_HEADS, OUTPUT_NAMES, make_inputs

ROOT = Path(__file__).resolve().parent.parent
RESULTS_CSV = ROOT / "results" / "runs.csv"
RESULT_COLUMNS = ("what", "batch", "setting", "figure", "unit", "commit", "gpu", "torch",
                  "triton", "date", "command")
# the contract's attention shape (ViT-L/14 at 336 px): tokens, heads, head dim, width
S, H, D = 577, 16, 64
E = H * D
L2_FLUSH_BYTES = 512 * 2 ** 20                # above the H100's and H200's 50 MB of L2


# ------------------------------------------------------------------------- inputs

def halves_of(*tensors):
    """The bf16 (hi, lo) halves of each tensor, flattened in order."""
    return [p for t in tensors for p in split_bf16_rounded(t.contiguous())]


def module_step(batch, autocast, stock):
    """One training step (forward, backward of a fixed gradient) of a contract-shaped
    VisionAttentionBlock, or of the stock block of its parameters (LayerNorm, Linear,
    SDPA, Linear), the forward under bf16 autocast with `autocast`."""
    torch.manual_seed(0)
    block = VisionAttentionBlock().cuda()
    model = reference.ReferenceBlock(block) if stock else block
    x = torch.randn(batch, S, E, device="cuda", requires_grad=True)
    grad = torch.randn_like(x)
    region = (lambda: torch.autocast("cuda", torch.bfloat16)) if autocast else \
        contextlib.nullcontext

    def step():
        with region():
            y = model(x)
        y.backward(grad)
    return step


def rel(a, b):
    """Normwise relative error of a against b, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def fresh_copies(args, count):
    """`count` copies of the inputs, each tensor at a new address."""
    return [tuple(a.clone() if torch.is_tensor(a) else a for a in args)
            for _ in range(count)]


# ------------------------------------------------------------------------- timing

def bench_ms(fn):
    """Median ms of fn() by triton.testing.do_bench, the L2 flushed before each run."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_us(step, calls, sleep_cycles=int(5e8), tries=4):
    """Host time per call of step(), with the GPU kept busy ahead of the calls by a sleep
    kernel. A timing counts only if that sleep was still running when the last call
    returned; otherwise some call waited for the GPU (the sleep was too short, or the
    calls' kernels filled the launch queue, which blocks the host until the GPU drains
    it) and it is timed again with half the calls and twice the sleep. NaN if no try
    was clean."""
    for _ in range(3):                                       # compile, warm up
        step()
    for _ in range(tries):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        sleep_done = torch.cuda.Event()
        sleep_done.record()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        elapsed = time.perf_counter() - start
        caught_up = sleep_done.query()                   # the GPU got past the sleep
        torch.cuda.synchronize()
        if not caught_up:
            return elapsed / calls * 1e6
        calls, sleep_cycles = max(1, calls // 2), 2 * sleep_cycles
    return float("nan")


def host_ms_per_call(fn, args, calls=10):
    """Host time per call (call to return) on a copy of the inputs, the GPU kept busy so
    that no call waits for it (host_us: NaN where every try had a call wait for it)."""
    inputs = fresh_copies(args, 1)[0]
    return host_us(lambda: fn(*inputs), calls) / 1e3


def spin_up(seconds=2.0):
    """An idle GPU sits at low clocks (345 MHz seen on the H200): keep it busy first."""
    a = torch.randn(4096, 4096, device="cuda")
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        torch.cuda.synchronize()


def harness_times(fn, args, calls=20, warmup=3):
    """The contract harness's timing of fn(*args) (scripts/bench.py's): medians over
    `calls` calls, each on inputs at fresh addresses after an L2 flush:
    span_ms (first kernel's start to last kernel's end, host gaps counted), event_ms
    (CUDA events around the call), busy_ms (the kernels' own time added up), copy_ms
    (of it, copies: a CUDA graph's input and output copies) and kernels (per call)."""
    for call_args in fresh_copies(args, warmup):
        fn(*call_args)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    copies = fresh_copies(args, calls)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for call_args, (start, end) in zip(copies, events):
            flush.fill_(1)
            torch.cuda.synchronize()
            start.record()
            fn(*call_args)
            end.record()
            torch.cuda.synchronize()
    del copies
    device_events = sorted((e for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA),
                           key=lambda e: e.time_range.start)
    # calls are separated by the flush kernel (a uint8 fill), one before each call
    calls_events, current = [], None
    for event in device_events:
        if "fill" in event.name.lower() and "unsigned char" in event.name:
            if current:
                calls_events.append(current)
            current = []
        elif current is not None:
            current.append(event)
    calls_events.append(current)
    calls_events = [c for c in calls_events if c]

    def duration_ms(events):
        return sum(e.time_range.end - e.time_range.start for e in events) / 1e3

    def median_of(per_call):
        return statistics.median(per_call(c) for c in calls_events)
    return dict(
        span_ms=median_of(lambda c: (max(e.time_range.end for e in c)
                                     - min(e.time_range.start for e in c)) / 1e3),
        event_ms=statistics.median(start.elapsed_time(end) for start, end in events),
        busy_ms=median_of(duration_ms),
        copy_ms=median_of(lambda c: duration_ms([e for e in c if _is_copy(e.name)])),
        kernels=median_of(len))


def _is_copy(kernel_name):
    """A copy kernel or memcpy: what a CUDA graph's static inputs and outputs cost."""
    name = kernel_name.lower()
    return "multi_tensor_apply" in name or "memcpy" in name or "copy_kernel" in name


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
    calls each, so that a drift of the machine's speed falls on all of them alike."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name] += step_times(step, device, repeats)
    return times


@contextlib.contextmanager
def deadline(seconds, what):
    """End the process (exit status 3) if the block, which must synchronize the GPU,
    takes longer than `seconds`: a kernel waiting on a semaphore that never comes
    would otherwise hang the device call until its limit."""
    def expire():
        print(f"HANG: {what} did not finish in {seconds} s", flush=True)
        os._exit(3)
    timer = threading.Timer(seconds, expire)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# ------------------------------------------------------------------ float64 check

MARGIN_CHUNK = 64                    # samples per float64 reference call (P: 2.7 GB)


def _misses(out, ref):
    return ((out.double() - ref).abs() > 1e-2 + 1e-2 * ref.abs()).sum().item()


def _chunk(value, start):
    """Samples start .. start + MARGIN_CHUNK of a batched input ([B,..], 3-d and up) in
    float64; weights in float64; scalars as they are."""
    if not torch.is_tensor(value):
        return value
    return (value[start:start + MARGIN_CHUNK] if value.dim() > 2 else value).double()


def contract_margins(batch, seed=0, precision="high", device="cuda"):
    """{output name: {"matched", "misses", "numel", "relative_error", "ref_rms"}} of the
    entry point at `batch` (577 tokens, 1024 wide, 16 heads; ln_grad "contract") against
    float64 under the rule |out - ref| <= 1e-2 + 1e-2 |ref|. The reference runs in chunks
    of the batch; the outputs other than grad_x are sums over it, added in float64."""
    if device == "cuda":
        # an earlier batch's freed blocks, cached, fragment the allocator's segments
        # (before batch 1,850: 42.6 GiB reserved but unallocated)
        torch.cuda.empty_cache()
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = make_inputs(batch, device=device, generator=generator)
    outputs = attention_block_backward(**inputs, num_heads=NUM_HEADS, ln_grad="contract",
                                       precision=precision)
    outputs = [t.detach() for t in outputs]
    sums, x_misses, x_error2, x_ref2 = None, 0, 0.0, 0.0
    with torch.no_grad():
        for start in range(0, batch, MARGIN_CHUNK):
            chunk = {name: _chunk(t, start) for name, t in inputs.items()}
            refs = reference.attention_block_backward(**chunk, num_heads=NUM_HEADS,
                                                      ln_grad="contract")
            grad_x = outputs[0][start:start + MARGIN_CHUNK]
            x_misses += _misses(grad_x, refs[0])
            x_error2 += ((grad_x.double() - refs[0]).norm() ** 2).item()
            x_ref2 += (refs[0].norm() ** 2).item()
            sums = list(refs[1:]) if sums is None else [s + r for s, r in zip(sums, refs[1:])]
    margins = {"grad_x": dict(misses=x_misses, numel=outputs[0].numel(),
                              relative_error=(x_error2 / x_ref2) ** 0.5,
                              ref_rms=(x_ref2 / outputs[0].numel()) ** 0.5)}
    for name, out, ref in zip(OUTPUT_NAMES[1:], outputs[1:], sums):
        margins[name] = dict(misses=_misses(out, ref), numel=ref.numel(),
                             relative_error=((out.double() - ref).norm() / ref.norm()).item(),
                             ref_rms=(ref.norm() / ref.numel() ** 0.5).item())
    for entry in margins.values():
        entry["matched"] = 1.0 - entry["misses"] / entry["numel"]
    return margins


# ------------------------------------------------------------------ results file

def run_environment():
    """{commit, gpu, torch, triton, date} of this run, for a results row."""
    # RUN_COMMIT names the package's commit where the copy that runs has no git history
    # of its own (a device's copy of the working tree)
    commit = os.environ.get("RUN_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                          capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    return dict(commit=commit or "unknown",
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, triton=triton_version,
                date=datetime.date.today().isoformat())


def append_results(rows, path=RESULTS_CSV):
    """Append measurements to the results file (a header first if it is new). Each row a
    dict with what, batch, setting, figure, unit and command; commit, gpu, torch, triton
    and date default to this run's (run_environment)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    environment = run_environment()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**environment, **row})


# scripts/bench.py's row keys -> the results file's `what` of the contract's figures
CONTRACT_FIGURES = {"vitattn_ms": ("contract span", "ms"),
                    "event_ms": ("contract CUDA-event time", "ms"),
                    "busy_ms": ("contract GPU busy", "ms"),
                    "host_ms": ("contract host time per call", "ms"),
                    "copy_ms": ("contract copies", "ms"),
                    "kernels": ("contract kernels per call", "kernels"),
                    "eager_ms": ("contract eager", "ms"),
                    "compiled_reference_ms": ("contract torch.compile(reference)", "ms"),
                    "previous_ms": ("contract span, the previous host path", "ms")}


def contract_rows(bench_rows, command, setting="float32 high, P given"):
    """The results file's rows of scripts/bench.py's per-batch rows (CONTRACT_FIGURES;
    keys a row lacks, or NaN, are left out)."""
    rows = []
    for row in bench_rows:
        for key, (what, unit) in CONTRACT_FIGURES.items():
            value = row.get(key)
            if value is not None and value == value:
                rows.append(dict(what=what, batch=row["batch"], setting=setting,
                                 figure=f"{value:.6g}", unit=unit, command=command))
    return rows


def read_results(path=RESULTS_CSV):
    """The rows of the results file, figure as a float (NaN where empty)."""
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["figure"] = float(row["figure"]) if row["figure"] else math.nan
    return rows


def plot_results(out_dir, path=RESULTS_CSV):
    """The performance page's plots from the results file, as PNGs in out_dir: the
    contract's span and eager time by batch (the latest commit's rows)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    rows = read_results(path)
    contract = [r for r in rows if r["what"] in ("contract span", "contract eager")]
    eager = [r for r in contract if r["what"] == "contract eager"]
    if not eager:
        return []
    latest = eager[-1]["commit"]                   # the last bench.py run's rows
    fig, ax = plt.subplots(figsize=(7, 4))
    for what in ("contract span", "contract eager"):
        points = sorted((int(r["batch"]), r["figure"]) for r in contract
                        if r["what"] == what and r["commit"] == latest and r["batch"])
        ax.plot(*zip(*points), marker="o", label=what)
    ax.set_xlabel("batch")
    ax.set_ylabel("ms")
    ax.set_title(f"the contract backward ({latest})")
    ax.legend()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    target = Path(out_dir, "contract.png")
    fig.savefig(target, dpi=120, bbox_inches="tight")
    return [target]
