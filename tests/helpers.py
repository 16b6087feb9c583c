"""Test helpers shared by every test file: the one input factory, the float64 reference
(of the backward and of a block's step), relative errors, the one table of relative-error bounds, the spies and the AdamW loop."""
import torch

from vitattn_bwd import reference
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs

# Relative error (Frobenius norm of the difference over the reference's) allowed per
# output, against the float64 reference, by path: the CPU float32 and float64 graphs
# (plain products), and the compiled CUDA path (float32-grade split products, except
# grad_qkv_weight, an fp16/TF32-grade product).
TOLERANCES = {
    ("cpu", torch.float32): dict.fromkeys(OUTPUT_NAMES, 1e-5),
    ("cpu", torch.float64): dict.fromkeys(OUTPUT_NAMES, 1e-12),
    ("cuda", torch.float32): {**dict.fromkeys(OUTPUT_NAMES, 1e-4), "grad_qkv_weight": 1e-3},
}


def bound(output_name, device="cpu", dtype=torch.float32):
    """The relative-error bound of one output on one path (device type, dtype)."""
    device_type = torch.device(device).type
    try:
        table = TOLERANCES[device_type, dtype]
    except KeyError:
        raise KeyError(f"no tolerance for {device_type} {dtype}: add one to "
                       "tests/helpers.TOLERANCES") from None
    return table[output_name]


def make_case(B, S, H, D, dtype=torch.float32, seed=0, device="cpu"):
    """The 15 inputs as the benchmark draws them (workloads.make_inputs), B x S tokens,
    H heads of D, reproducible from `seed`."""
    g = torch.Generator(device=device).manual_seed(seed)
    return make_inputs(B, seq_len=S, embed_dim=H * D, num_heads=H, device=device,
                       dtype=dtype, generator=g)


def reference_grads(inputs, num_heads, ln_grad, dtype=torch.float64, device="cpu",
                    chunk=None):
    """The seven gradients by the reference in `dtype` on `device`; with `chunk`, over
    that many samples at a time (grad_x concatenated, the weight gradients summed), so
    that a large batch's float64 P and its gradients fit the device."""
    def grads_of(rows):
        # the per-sample inputs have 3 or more dimensions; the weights fewer
        args = {name: (t[rows] if t.dim() >= 3 else t).to(device=device, dtype=dtype)
                if torch.is_tensor(t) else t for name, t in inputs.items()}
        return reference.attention_block_backward(**args, num_heads=num_heads,
                                                  ln_grad=ln_grad)

    batch = inputs["x"].shape[0]
    if chunk is None or chunk >= batch:
        return grads_of(slice(None))
    parts = [grads_of(slice(start, start + chunk)) for start in range(0, batch, chunk)]
    grad_x = torch.cat([p[0] for p in parts])
    return (grad_x, *(sum(p[i] for p in parts) for i in range(1, len(OUTPUT_NAMES))))


def block_step(block, x, grad_y):
    """[y, grad of x, grad of each parameter] of one forward and backward of `block` on x
    (detached: a leaf of its own) with upstream gradient grad_y."""
    x = x.detach().requires_grad_()
    y = block(x)
    return [y] + list(torch.autograd.grad(y, [x, *block.parameters()], grad_y))


def block_step_float64(block, x, grad_y):
    """block_step's outputs by float64 autograd through the stock block
    (reference.block_forward) on the same values: x, the parameters and grad_y upcast
    exactly."""
    params = [p.detach().double().requires_grad_() for p in block.parameters()]
    x64 = x.detach().double().requires_grad_()
    y64 = reference.block_forward(x64, *params, num_heads=block.num_heads, eps=block.eps)
    return [y64] + list(torch.autograd.grad(y64, [x64, *params], grad_y.double()))


def block_against_stock(block, x, grad_y):
    """block_step of `block` twice and of the stock block (reference.ReferenceBlock) on
    the same x, in the caller's autocast region if any (which leaves the float64 truth
    alone): (ours, ours again, stock, [(name, ours, stock, ours' relative error, stock's)
    for y, x and each parameter, against block_step_float64])."""
    ours = block_step(block, x, grad_y)
    again = block_step(block, x, grad_y)
    stock = block_step(reference.ReferenceBlock(block), x, grad_y)
    truth = block_step_float64(block, x, grad_y)
    names = ["y", "x"] + [name for name, _ in block.named_parameters()]
    return ours, again, stock, list(zip(names, ours, stock, relative_errors(ours, truth),
                                        relative_errors(stock, truth)))


def float32_grade_bound(name):
    """The relative-error bound against float64 of a float32 block's y (name "y") or a
    gradient (x or a parameter's name) at precision "high" on CUDA: bf16x3 products,
    the QKV weight's gradient one fp16 product."""
    if name == "y":
        return 1e-5            # bf16x3 projections (rounded splits): ~4e-6
    return 1e-3 if name == "qkv.weight" else 1e-4


def relative_error(output, ref):
    """Normwise relative error of `output` against `ref`, in float64."""
    return ((output.double() - ref.double()).norm() / ref.double().norm()).item()


def relative_errors(outputs, refs):
    return [relative_error(o, r) for o, r in zip(outputs, refs)]


def assert_within_bounds(outputs, inputs, num_heads, ln_grad):
    """Every output within its TOLERANCES bound of the float64 reference; the path is the
    outputs' device and dtype. Returns {name: relative error}."""
    refs = reference_grads(inputs, num_heads, ln_grad)
    errors = dict(zip(OUTPUT_NAMES, relative_errors(outputs, refs)))
    device, dtype = outputs[0].device, outputs[0].dtype
    over = {name: (err, bound(name, device, dtype)) for name, err in errors.items()
            if not err <= bound(name, device, dtype)}
    assert not over, f"over the bound (error, bound) on {device} {dtype}: {over}"
    return errors


def recorded_calls(monkeypatch, owner, name, record):
    """A spy: `owner.name` (a module's function or a class's method) wrapped, for this
    test only, so that each call still runs it and first appends record(*args, **kwargs)
    to the list returned."""
    calls = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, recording)
    return calls


def jit_path_launch(kernel, grid, *args, **kwargs):
    """A stand-in for vitattn_bwd.launcher.launch that takes triton's JIT path on every
    call (patched in where a test compares the launch cache with it)."""
    kernel[grid](*args, **kwargs)


def recorded_jit_runs(monkeypatch, kernel):
    """A spy on `kernel`'s JIT path (its run, which the launch cache's later launches
    skip): a list with one entry per call from now on, for this test only."""
    return recorded_calls(monkeypatch, kernel, "run", lambda *args, **kwargs: None)


def recorded_half_dtypes(monkeypatch):
    """The half dtype (None: float32 math) of each fused forward, as called: a list that
    fills as module.attention_block_forward runs (patched for this test only)."""
    from vitattn_bwd import module
    return recorded_calls(monkeypatch, module, "attention_block_forward",
                          lambda *args: args[9].half_dtype)


def adamw_losses(model, loss_of, batch_of, steps, lr):
    """`steps` AdamW steps (learning rate `lr`) of `model` in training mode, step i on the
    loss loss_of(model, *batch_of(i)); the losses, as Python floats."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, *batch_of(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def update_difference(ours, stock, start, skip=()):
    """How far two models' updates from the same `start` ({name: parameter}) differ:
    |ours - stock| / |stock - start| over every parameter whose name ends in none of
    `skip`; and {name: that parameter's squared norm of ours - stock}."""
    squared, total = {}, 0.0
    for (name, a), (_, b) in zip(ours.named_parameters(), stock.named_parameters()):
        if name.endswith(tuple(skip)):
            continue
        squared[name] = ((a - b).double().norm() ** 2).item()
        total += ((b - start[name]).double().norm() ** 2).item()
    return (sum(squared.values()) / total) ** 0.5, squared


# Where .ci/run installed the newest triton a fresh GPU install resolves (a folder of its
# own, outside this environment): the compile-for-sm_90 tests run with it too.
NEWEST_TRITON_VARIABLE = "VITATTN_BWD_NEWEST_TRITON"


def triton_environments():
    """{label: environment} for subprocesses that compile kernels for sm_90, without
    Triton's interpreter: the installed triton, and the newest one where .ci/run put it
    (NEWEST_TRITON_VARIABLE, first on PYTHONPATH)."""
    import os
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environments = {"installed triton": base}
    newest = os.environ.get(NEWEST_TRITON_VARIABLE)
    if newest:
        path = os.pathsep.join(p for p in (newest, base.get("PYTHONPATH")) if p)
        environments["newest triton"] = dict(base, PYTHONPATH=path)
    return environments


def triton_version_in(environment):
    """The triton version a subprocess with `environment` imports."""
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"],
                          env=environment, capture_output=True, text=True,
                          check=True).stdout.strip()


H200_SHARED_MEMORY = 227 * 1024          # bytes a block may use on sm_90


def sm90_compile_report(script_args, environment, timeout):
    """What a script prints as JSON on its last line after compiling kernels for sm_90
    (scripts/kernel_resources.py --json, scripts/time_kernels.py --kernel core_ws
    --sm90), run from the repository root in a subprocess with `environment` (triton_environments): in this
    process the interpreter (set by conftest) would replace the compiler. Skips where
    that triton has no CUDA backend."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    # this tree's package, whichever one is installed (the scripts edit no sys.path)
    path = os.pathsep.join(p for p in (str(root), environment.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, *script_args], cwd=root,
                            env=dict(environment, PYTHONPATH=path),
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode and "No module named 'triton.backends.nvidia" in result.stderr:
        pytest.skip("this triton has no CUDA backend")
    assert result.returncode == 0, (triton_version_in(environment), result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def graph_breaks_and_ops(model, *args, **kwargs):
    """torch._dynamo.explain's graph-break count for model(*args, **kwargs), and the
    vitattn_bwd operators in its graphs."""
    explanation = torch._dynamo.explain(model)(*args, **kwargs)
    ops = {str(node.target) for gm in explanation.graphs for node in gm.graph.nodes
           if "vitattn_bwd" in str(node.target)}
    return explanation.graph_break_count, ops


def dispatched_ops():
    """A context (TorchDispatchMode) whose `names` lists the tensor operations dispatched
    inside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class DispatchedOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))
    return DispatchedOps()
