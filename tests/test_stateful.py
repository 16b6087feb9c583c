"""Stateful property (CPU): a sequence of calls to vitattn_bwd.attention_block_backward
with shapes, batch sizes, LayerNorm modes and calling threads drawn in sequence.

Invariants, after every step:
- results equal the float64 reference within 1e-5 (plain float32 products on the CPU);
- inputs untouched; a repeated call gives bitwise the same outputs and compiles nothing;
- graphs: graph.py keeps one graph per configuration key and batch bucket (1 | 2-15 |
  16+); a dynamic bucket may compile once more (a size failing a guard of its first
  compile). Counted with torch._dynamo.utils.counters["stats"]["unique_graphs"]: at most 1
  per (configuration, batch 1) and 2 per (configuration, dynamic bucket) pair seen;
- no setting changed: process-wide ones (TF32 flags, float32 matmul precision, the
  default dtype, thread count, deterministic algorithms, os.environ) before vs after
  each call, and observed from another thread during the call; torch._dynamo.config and
  torch.compiler.config values (recompile limits, cache_key_tag, ...) before vs after,
  in the calling thread (in torch 2.13 their overrides and patch() are thread-local, so
  another thread cannot see them).

Tiny shapes (S <= 16, E <= 32) and few steps: each new (shape, mode, bucket) compiles.
"""
import os
import sys
import threading
import time

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)
from hypothesis import settings

import vitattn_bwd
from vitattn_bwd.graph import batch_bucket
from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs

from . import plants
from . import strategies as S

SHAPES = ((5, 2, 8), (16, 2, 16))             # (seq_len, heads, head_dim): E = 16, 32
BATCHES = (1, 2, 3, 16, 17)                   # every bucket, twice in the dynamic ones
THREADS = ("main", "worker")
BOUND = 1e-5                                  # float32 on the CPU

DYNAMO_KEYS = ("recompile_limit", "accumulated_recompile_limit",
               "fail_on_recompile_limit_hit", "automatic_dynamic_shapes",
               "assume_static_by_default", "capture_scalar_outputs")
COMPILER_KEYS = ("cache_key_tag", "dynamic_shapes")
INDUCTOR_KEYS = ("max_autotune", "max_autotune_gemm", "coordinate_descent_tuning",
                 "fx_graph_cache", "freezing")


# Set by Inductor itself, once per process, when it loads its first C++ kernel module
# (torch/_inductor/codecache.py): torch's business, not a setting of ours.
TORCH_OWN_ENVIRON = ("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",)


def _read(getter):
    """A setting's value, or what reading it raised (torch raises from
    get_float32_matmul_precision() once the legacy and the per-backend TF32 APIs
    disagree: a changed setting too)."""
    try:
        return getter()
    except Exception as e:                   # noqa: BLE001 (recorded, compared)
        return f"raises {type(e).__name__}: {str(e)[:60]}"


def process_wide():
    """Settings every thread shares."""
    matmul = torch.backends.cuda.matmul
    return dict(
        cuda_matmul_allow_tf32=_read(lambda: matmul.allow_tf32),
        cudnn_allow_tf32=_read(lambda: torch.backends.cudnn.allow_tf32),
        float32_matmul_precision=_read(torch.get_float32_matmul_precision),
        cuda_matmul_fp32_precision=_read(lambda: matmul.fp32_precision),
        mkldnn_matmul_fp32_precision=_read(lambda: torch.backends.mkldnn.matmul.fp32_precision),
        generic_fp32_precision=_read(lambda: torch.backends.fp32_precision),
        bf16_reduced_reduction=_read(lambda: matmul.allow_bf16_reduced_precision_reduction),
        fp16_reduced_reduction=_read(lambda: matmul.allow_fp16_reduced_precision_reduction),
        default_dtype=torch.get_default_dtype(),
        num_threads=torch.get_num_threads(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        environ={k: v for k, v in os.environ.items() if k not in TORCH_OWN_ENVIRON})


def thread_visible():
    """process_wide() plus the compile configs as the calling thread sees them."""
    snap = process_wide()
    snap.update({f"dynamo.{k}": getattr(torch._dynamo.config, k) for k in DYNAMO_KEYS})
    snap.update({f"compiler.{k}": getattr(torch.compiler.config, k) for k in COMPILER_KEYS})
    snap.update({f"inductor.{k}": getattr(torch._inductor.config, k) for k in INDUCTOR_KEYS})
    return snap


def changes(before, after):
    out = {}
    for k in before.keys() | after.keys():
        if k == "environ":
            diff = {n: (before[k].get(n), after[k].get(n))
                    for n in before[k].keys() | after[k].keys()
                    if before[k].get(n) != after[k].get(n)}
            if diff:
                out[k] = diff
        elif before.get(k) != after.get(k):
            out[k] = (before.get(k), after.get(k))
    return out


PACKAGE_DIR = os.path.dirname(vitattn_bwd.__file__)


class Observer:
    """Another thread that snapshots process_wide() while a call runs. Deterministic: a
    profile hook on the calling thread stops it at every entry into and return from a
    function of vitattn_bwd or of Inductor's generated code, and waits until the observer
    has taken a snapshot there. `during` counts those snapshots."""

    def __init__(self, baseline):
        self.baseline = baseline
        self.request, self.done, self.stop = (threading.Event() for _ in range(3))
        self.during = 0
        self.seen = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            if not self.request.wait(0.01):
                continue
            self.request.clear()
            self.seen.update(changes(self.baseline, process_wide()))
            self.during += 1
            self.done.set()

    def _hook(self, frame, event, arg):
        if event in ("call", "return"):
            filename = frame.f_code.co_filename
            if filename.startswith(PACKAGE_DIR) or "torchinductor" in filename:
                self.done.clear()
                self.request.set()
                self.done.wait()

    def watch(self, fn):
        """fn() with the hook set on the calling thread."""
        sys.setprofile(self._hook)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _call(inputs, num_heads, ln_grad):
    return vitattn_bwd.attention_block_backward(**inputs, num_heads=num_heads,
                                                ln_grad=ln_grad)


def run_in(thread, fn):
    """fn() on the main thread or a fresh worker thread; returns (result, before, after)
    with thread_visible() snapshots taken on the calling thread around the call."""
    box = {}

    def target():
        try:
            before = thread_visible()
            result = fn()
            box["value"] = (result, before, thread_visible())
        except BaseException as e:           # re-raised on the test's thread
            box["error"] = e

    if thread == "main":
        target()
    else:
        worker = threading.Thread(target=target)
        worker.start()
        worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# (dtype, S, E, H, scale, eps, ln_grad, TF32 on, bucket) -> graphs compiled while this
# module watched (the graphs live for the process: shared by all machines of a run).
# TF32 is in the key because dynamo's global-state guard covers it: a user's switch of
# torch's float32 matmul precision between "highest" and "high" / "medium" compiles
# each of our graphs once more (docs/compile_cache.md).
GRAPHS = {}


def _tf32():
    return torch.backends.cuda.matmul.allow_tf32


def allowed_graphs(key):
    return 1 if key[-1] is None else 2


class BackwardCalls(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.saved_precision = torch.get_float32_matmul_precision()
        self.baseline = thread_visible()
        self.keys = set()
        self.compiled = 0
        self.last = None

    def _do(self, shape, batch, ln_grad, thread, seed):
        seq_len, heads, head_dim = shape
        gen = torch.Generator().manual_seed(seed)
        inputs = make_inputs(batch, seq_len=seq_len, embed_dim=heads * head_dim,
                             num_heads=heads, generator=gen)
        saved = {n: t.clone() for n, t in inputs.items() if torch.is_tensor(t)}
        key = (torch.float32, seq_len, heads * head_dim, heads, inputs["scale"],
               inputs["norm_eps"], ln_grad, _tf32(),
               batch_bucket(batch))
        counters = torch._dynamo.utils.counters["stats"]
        graphs_before = counters["unique_graphs"]
        observer = Observer(process_wide())
        with observer:
            grads, before, after = run_in(
                thread, lambda: observer.watch(lambda: _call(inputs, heads, ln_grad)))
        compiled = counters["unique_graphs"] - graphs_before
        stats = S.RUN_STATS.setdefault("stateful machine", {
            "examples": 0, "rejected_over_budget": 0, "seconds": 0.0, "max_errors": {},
            "plant": None})
        stats["examples"] += 1                        # here: calls, in every run so far
        GRAPHS[key] = GRAPHS.get(key, 0) + compiled
        self.keys.add(key)
        self.compiled += compiled

        for name, t in saved.items():
            assert torch.equal(inputs[name], t), f"{name} was modified"
        refs = S.block_reference({**inputs, **saved}, heads, ln_grad, "cpu")
        for name, out, ref in zip(OUTPUT_NAMES, grads, refs):
            assert out.dtype == torch.float32 and out.shape == ref.shape, name
            err = S.relative_error(out, ref)
            assert err <= BOUND, (name, err, shape, batch, ln_grad, thread)
        assert not changes(before, after), ("settings changed by the call", thread,
                                            changes(before, after))
        assert not observer.seen, ("settings changed during the call (seen from another "
                                   "thread)", observer.seen)
        assert observer.during >= 2, "the observer did not look during the call"
        assert GRAPHS[key] <= allowed_graphs(key), ("recompiled", key, GRAPHS[key])
        return inputs, grads, compiled

    @rule(shape=st.sampled_from(SHAPES), batch=st.sampled_from(BATCHES),
          ln_grad=st.sampled_from(("exact", "contract")), thread=st.sampled_from(THREADS),
          seed=st.integers(0, 2 ** 16))
    def call(self, shape, batch, ln_grad, thread, seed):
        _, grads, _ = self._do(shape, batch, ln_grad, thread, seed)
        self.last = (shape, batch, ln_grad, thread, seed), grads, _tf32()

    @precondition(lambda self: self.last is not None)
    @rule(thread=st.sampled_from(THREADS))
    def repeat_last_call(self, thread):
        """The same call again (from a drawn thread): bitwise the same outputs, and no
        compile unless the user switched TF32 in between (then at most the one that
        _do's count allows)."""
        (shape, batch, ln_grad, _, seed), previous, tf32 = self.last
        _, grads, compiled = self._do(shape, batch, ln_grad, thread, seed)
        if _tf32() == tf32:
            assert compiled == 0, ("a repeated call compiled", compiled)
        for name, a, b in zip(OUTPUT_NAMES, grads, previous):
            assert torch.equal(a, b), f"{name} differs between two identical calls"

    @rule(precision=st.sampled_from(("highest", "high", "medium")))
    def user_sets_float32_matmul_precision(self, precision):
        """A user's own setting (what a training script does): calls must leave it so."""
        torch.set_float32_matmul_precision(precision)
        self.baseline = thread_visible()

    def teardown(self):
        torch.set_float32_matmul_precision(self.saved_precision)

    @invariant()
    def graphs_within_documented_count(self):
        assert self.compiled <= sum(allowed_graphs(k) for k in self.keys), (
            self.compiled, sorted(map(str, self.keys)))

    @invariant()
    def settings_unchanged(self):
        assert not changes(self.baseline, thread_visible()), changes(self.baseline,
                                                                     thread_visible())


def _run_machine(**overrides):
    kwargs = dict(max_examples=S.profile_examples(3, 20),
                  stateful_step_count=S.profile_examples(6, 20), deadline=None)
    kwargs.update(overrides)
    run_state_machine_as_test(BackwardCalls, settings=settings(settings.default, **kwargs))


def test_call_sequences_keep_the_invariants():
    start = time.monotonic()
    with plants.planted(plants.from_env()):
        _run_machine()
    stats = S.RUN_STATS.get("stateful machine")
    if stats is not None:                     # "examples" counts calls here
        stats["seconds"] = time.monotonic() - start


# A fixed script through the machine's rules and invariants: the planted runs must not
# depend on which steps hypothesis happens to draw.
def _script():
    machine = BackwardCalls()
    steps = [lambda: machine.call(SHAPES[0], 2, "exact", "worker", 1),
             lambda: machine.repeat_last_call("main"),
             lambda: machine.call(SHAPES[0], 3, "exact", "main", 2),
             lambda: machine.call(SHAPES[0], 1, "contract", "worker", 3),
             lambda: machine.repeat_last_call("worker")]
    for step in steps:
        step()
        machine.graphs_within_documented_count()
        machine.settings_unchanged()
    machine.teardown()


def test_script_passes_without_plant():
    _script()


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_a_call_leaves_the_users_float32_matmul_precision(precision):
    """The machine's user_sets_float32_matmul_precision rule, for each value, then a call
    (a configuration the script compiled already)."""
    machine = BackwardCalls()
    try:
        machine.user_sets_float32_matmul_precision(precision)
        machine.call(SHAPES[0], 2, "exact", "main", 4)
        machine.settings_unchanged()
    finally:
        machine.teardown()


@pytest.mark.parametrize("plant", ["drop_lo", "round_out", "mutate_input", "leak_setting",
                                   "setting_during_call", "recompile"])
def test_invariants_catch(plant):
    with plants.planted(plant), pytest.raises(AssertionError) as caught:
        _script()
    # the invariant meant for the plant is the one that fired
    expected = {"drop_lo": "grad_", "round_out": "grad_", "mutate_input": "was modified",
                "leak_setting": "settings changed by the call",
                "setting_during_call": "seen from another thread",
                "recompile": "compiled"}[plant]
    assert expected in str(caught.value), str(caught.value)[:500]
