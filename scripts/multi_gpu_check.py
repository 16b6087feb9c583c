"""VisionAttentionBlock's gradients on two processes, under DistributedDataParallel and
under FSDP2 (torch.distributed.fsdp.fully_shard), against one process computing the
whole batch.

    PYTHONPATH=. python3 scripts/multi_gpu_check.py          # 2 CUDA GPUs, NCCL
    PYTHONPATH=. python3 scripts/multi_gpu_check.py --cpu    # CPU, gloo, tiny shapes

Two spawned processes (no torchrun) each build the same tower of blocks (GPU: 2 blocks,
577 tokens, 1024 wide, 16 heads; CPU: 2 blocks, 9 tokens, 16 wide, 2 heads), run one
forward and backward on their half of the batch (2 images each), float32, TF32 off:
first under DDP (gradients all-reduced), then a fresh copy under FSDP2 (gradients
reduce-scattered, gathered here with full_tensor()). Rank 0 then computes the whole batch
(4 images) in one plain model on its device (GPU 0). The parent prints, per parameter,
the relative error ||got - want|| / ||want|| against that single-process gradient (the
larger of the two ranks') for DDP and FSDP2, and exits 0 if every one is within the
bound (1e-4 on CUDA, 1e-3 for qkv.weight: the package's float32-grade precision, whose
QKV weight gradient is one fp16 GEMM; 1e-5 on the CPU), 1 if not, 2 if a worker failed
or the run exceeded --timeout (workers are then killed).

Workers shut down the way docs/distributed.md recommends: models deleted, a barrier,
destroy_process_group, a normal return; the parent joins them. The environment passed to
the workers sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (machines
whose NVLink multicast must stay off) and, unless already set,
VITATTN_BWD_COMPILE_MODE=default (no GEMM autotuning: the first backward compiles in
tens of seconds instead of minutes).
"""
import argparse
import datetime
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
GPU_SHAPE = dict(blocks=2, tokens=577, width=1024, heads=16, batch_per_rank=2)
CPU_SHAPE = dict(blocks=2, tokens=9, width=16, heads=2, batch_per_rank=2)
ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def bound_for(name, cpu):
    """Allowed relative error of one parameter's gradient against one process's."""
    if cpu:
        return 1e-5
    return 1e-3 if name.endswith("qkv.weight") else 1e-4


def relative_errors(got, want):
    """name -> ||got - want|| / ||want|| (float64 norms); NaN where `got` lacks the name
    or its shape differs."""
    errors = {}
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            errors[name] = math.nan
            continue
        w64, g64 = w.double(), g.double()
        errors[name] = ((g64 - w64).norm() / w64.norm().clamp_min(1e-300)).item()
    return errors


def failures(errors, bound):
    """Names whose error is not below the bound (a number or a function of the name); NaN
    fails."""
    limit = bound if callable(bound) else (lambda name: bound)
    return [name for name, err in errors.items() if not err < limit(name)]


def build_tower(shape, device):
    from vitattn_bwd import VisionAttentionBlock
    torch.manual_seed(0)                 # the same weights in every process
    return nn.Sequential(*(VisionAttentionBlock(shape["width"], shape["heads"])
                           for _ in range(shape["blocks"]))).to(device)


def _grads(model, full=False):
    """name -> gradient on the CPU (FSDP2's sharded DTensor gradients gathered whole)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if full else p.grad
        out[name] = g.detach().cpu()
    return out


def worker(rank, cpu, shape, init_file, x, grad_y, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if cpu:
        device, backend, device_id = torch.device("cpu"), "gloo", None
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend, device_id = "nccl", device
    # a generous collective timeout: rank 1 waits in the final barrier while rank 0
    # compiles and runs the single-process batch; the parent's --timeout bounds the run
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=600),
                            device_id=device_id)
    x_shard = x.chunk(WORLD)[rank].to(device)
    grad_shard = grad_y.chunk(WORLD)[rank].to(device)
    timings = {}

    start = time.monotonic()
    ddp = nn.parallel.DistributedDataParallel(
        build_tower(shape, device), device_ids=None if cpu else [rank])
    ddp(x_shard).backward(grad_shard)
    ddp_grads = _grads(ddp.module)
    timings["ddp_s"] = time.monotonic() - start

    start = time.monotonic()
    mesh = init_device_mesh(device.type, (WORLD,))
    sharded = build_tower(shape, device)
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded(x_shard).backward(grad_shard)
    fsdp_grads = _grads(sharded, full=True)
    timings["fsdp2_s"] = time.monotonic() - start

    torch.save({"ddp": ddp_grads, "fsdp2": fsdp_grads, "timings": timings},
               os.path.join(out_dir, f"rank{rank}.pt"))
    del ddp, sharded, mesh             # models first: see docs/distributed.md

    if rank == 0:
        # one process, the whole batch; DDP and FSDP2 average the ranks' gradients
        start = time.monotonic()
        single = build_tower(shape, device)
        single(x.to(device)).backward(grad_y.to(device) / WORLD)
        torch.save({"grads": _grads(single), "seconds": time.monotonic() - start},
                   os.path.join(out_dir, "single.pt"))
        del single
    dist.barrier()
    dist.destroy_process_group()


def run(cpu, timeout_s):
    shape = CPU_SHAPE if cpu else GPU_SHAPE
    if not cpu and torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} CUDA GPUs, found {torch.cuda.device_count()} (--cpu runs "
              "on the CPU)")
        return 2
    os.environ.update(ENVIRONMENT)                 # the spawned workers inherit these
    os.environ.setdefault("VITATTN_BWD_COMPILE_MODE", "default")
    g = torch.Generator().manual_seed(1)
    batch = WORLD * shape["batch_per_rank"]
    x = torch.randn(batch, shape["tokens"], shape["width"], generator=g)
    grad_y = torch.randn(batch, shape["tokens"], shape["width"], generator=g)
    where = "CPU, gloo" if cpu else ", ".join(torch.cuda.get_device_name(i)
                                              for i in range(WORLD)) + ", NCCL"
    print(f"torch {torch.__version__}; {WORLD} processes on {where}; {shape}; float32, "
          f"compile mode {os.environ['VITATTN_BWD_COMPILE_MODE']}", flush=True)

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            worker, args=(cpu, shape, os.path.join(tmp, "init"), x, grad_y, tmp),
            nprocs=WORLD, join=False, start_method="spawn")
        try:
            while not context.join(timeout=1):
                if time.monotonic() - start > timeout_s:
                    finished = sorted(n for n in os.listdir(tmp) if n.endswith(".pt"))
                    for process in context.processes:
                        process.kill()
                    print(f"FAIL: workers still running after {timeout_s} s (killed); "
                          f"results written: {finished}")
                    return 2
        except mp.ProcessException as error:      # a worker raised or died
            print(f"FAIL: {error}")
            return 2
        wall = time.monotonic() - start
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
        single = torch.load(os.path.join(tmp, "single.pt"))

    want = single["grads"]
    table = {}
    for mode in ("ddp", "fsdp2"):
        per_rank = [relative_errors(r[mode], want) for r in ranks]
        table[mode] = {name: max(errs[name] for errs in per_rank) for name in want}
    print(f"\nrelative error of each gradient against one process (max over the "
          f"{WORLD} ranks)")
    print(f"{'parameter':<22} {'DDP':>10} {'FSDP2':>10} {'bound':>8}")
    for name in want:
        print(f"{name:<22} {table['ddp'][name]:>10.2e} {table['fsdp2'][name]:>10.2e} "
              f"{bound_for(name, cpu):>8.0e}")
    timing = ranks[0]["timings"]
    print(f"\nrank 0: DDP step {timing['ddp_s']:.1f} s, FSDP2 step "
          f"{timing['fsdp2_s']:.1f} s, single process {single['seconds']:.1f} s; "
          f"all workers joined after {wall:.1f} s")
    failed = {mode: failures(table[mode], lambda n: bound_for(n, cpu)) for mode in table}
    if any(failed.values()):
        print(f"FAIL: over the bound: {failed}")
        return 1
    print("PASS: DDP and FSDP2 gradients match one process; workers exited cleanly")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="gloo on the CPU with tiny shapes (no GPU needed)")
    parser.add_argument("--timeout", type=float, default=170,
                        help="seconds before the workers are killed (default 170)")
    args = parser.parse_args(argv)
    return run(args.cpu, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
