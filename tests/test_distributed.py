"""VisionAttentionBlock's gradients under DistributedDataParallel and FSDP2 (gloo, 2
processes) against one process: scripts/multi_gpu_check.py's CPU mode, whose workers
shut down by normal interpreter exit within its deadline (no os._exit;
docs/distributed.md); and the documented teardown order with a collective in flight."""
import datetime
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def _stacks(pids):
    """py-spy stacks (Python and native) of the given processes, if py-spy is installed."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return "(install py-spy to see the hung workers' stacks)"
    dumps = []
    for pid in pids:
        run = subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=60)
        dumps.append(f"--- pid {pid}\n{run.stdout}{run.stderr}")
    return "\n".join(dumps)


def join_or_fail(context, out_dir, deadline_s, exit_grace_s=60):
    """Join mp.spawn(join=False)'s workers. A worker that raised fails the test with its
    traceback (ProcessRaisedException); workers still alive after `deadline_s`, or more
    than `exit_grace_s` after every one of them finished its work (a hang at exit), are
    killed and fail it with their stacks."""
    start = time.monotonic()
    all_done_at = None
    while not context.join(timeout=1):
        now = time.monotonic()
        done = sorted(p.name for p in Path(out_dir).glob("done*"))
        if all_done_at is None and len(done) == len(context.processes):
            all_done_at = now
        hung_at_exit = all_done_at is not None and now - all_done_at > exit_grace_s
        if now - start > deadline_s or hung_at_exit:
            alive = [p.pid for p in context.processes if p.is_alive()]
            stacks = _stacks(alive)
            for process in context.processes:
                process.kill()
            what = (f"did not exit within {exit_grace_s} s of finishing their work"
                    if hung_at_exit else f"did not finish within {deadline_s} s")
            pytest.fail(f"workers {alive} {what} (finished: {done})\n{stacks}")
    return time.monotonic() - start


def _plain_gloo_group(store_path, rank):
    """A gloo process group that only the caller and what it is passed to reference (what
    init_process_group builds, minus the registry): plain torch, no vitattn_bwd."""
    store = dist.FileStore(store_path, WORLD)
    backend = dist.ProcessGroupGloo(store, rank, WORLD, datetime.timedelta(seconds=60))
    group = dist.ProcessGroup(store, rank, WORLD)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def _teardown_order_worker(rank, store_path, out_dir):
    """The upstream deadlock's setup (docs/distributed.md): a gloo thread still holds an
    all-reduce of a tensor Python has dropped (rank 1 joins it late), so freeing that
    work needs the GIL. Freeing the DDP model while the group is alive, then the group,
    exits; the other order (group reference dropped first, then the model: ~Reducer joins
    gloo's threads holding the GIL) hangs on torch 2.13."""
    group = _plain_gloo_group(store_path, rank)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4), process_group=group)
    model(torch.randn(2, 4)).sum().backward()
    t = torch.ones(1000)
    if rank == 1:
        time.sleep(2)
    work = group.allreduce([t])
    del t, work
    Path(out_dir, f"done{rank}").touch()
    del model                       # the documented order: the model first,
    del group                       # then the group (pybind frees it without the GIL)


def test_documented_teardown_order_exits_with_a_collective_in_flight():
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.spawn(_teardown_order_worker, args=(os.path.join(tmp, "store"), tmp),
                           nprocs=WORLD, join=False)
        join_or_fail(context, tmp, deadline_s=120, exit_grace_s=20)
        assert [p.exitcode for p in context.processes] == [0] * WORLD


def _load_check_script():
    spec = importlib.util.spec_from_file_location("multi_gpu_check",
                                                  ROOT / "scripts" / "multi_gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_multi_gpu_check_comparison_catches_a_wrong_gradient():
    check = _load_check_script()
    want = {"a.weight": torch.randn(8, 4), "a.bias": torch.randn(8)}
    good = {k: v * (1 + 1e-7) for k, v in want.items()}
    assert check.failures(check.relative_errors(good, want), bound=1e-5) == []
    bad = dict(good, **{"a.bias": want["a.bias"] * 1.01})
    assert check.failures(check.relative_errors(bad, want), bound=1e-5) == ["a.bias"]
    assert check.failures(check.relative_errors({"a.weight": good["a.weight"]}, want),
                          bound=1e-5) == ["a.bias"]                   # a missing gradient
    nan = dict(good, **{"a.weight": torch.full((8, 4), float("nan"))})
    assert check.failures(check.relative_errors(nan, want), bound=1e-5) == ["a.weight"]


def test_multi_gpu_check_cpu_mode_passes_and_exits_cleanly():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "multi_gpu_check.py"),
                          "--cpu", "--timeout", "150"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    for name in ("0.norm.weight", "1.qkv.weight", "1.out_proj.bias"):
        rows = [line for line in out.splitlines() if line.startswith(name + " ")]
        assert len(rows) == 1, out
        ddp_err, fsdp_err = (float(v) for v in rows[0].split()[1:3])
        assert ddp_err < 1e-5 and fsdp_err < 1e-5, rows[0]
    assert "PASS" in out, out
    print(f"multi_gpu_check --cpu: {elapsed:.1f} s")
