"""On the GPU: a float32 VisionAttentionBlock compiled cold with max-autotune prints
nothing at warning or error level. Before inductor.compile_options pruned GEMM configs
by shared memory, a swapped timm model in float32 printed three lines like
`E1201 ... select_algorithm.py:3924] ... No valid triton configs. OutOfMemoryError: out
of resource: triton_mm Required: 262144 Hardware limit:232448` (the step ran right).

The block runs in a subprocess with an empty Inductor cache and caches disabled, so
every candidate is compiled and timed (a warm cache would skip autotuning and pass
without testing anything); its stderr, where torch's log handler writes, is read for
torch's warning / error lines. About 3-5 minutes on an H200 (cut off at 570 s)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent

# forward and backward at batch 32 (the 16-and-up graphs) in float32, at precision None
# under torch's default float32 matmul precision ("highest": the split GEMMs) and at
# "high"; then a check that the step was right, so a crash cannot pass
SCRIPT = r"""
import torch
from vitattn_bwd import VisionAttentionBlock, reference
torch.backends.cuda.matmul.allow_tf32 = False
for precision in (None, "high"):
    torch.manual_seed(0)
    block = VisionAttentionBlock(1024, 16, precision=precision).cuda()
    x = torch.randn(32, 577, 1024, device="cuda", requires_grad=True)
    y = block(x)
    (grad_x,) = torch.autograd.grad(y, [x], torch.ones_like(y))
    stock_x = x.detach().requires_grad_()
    stock_y = reference.ReferenceBlock(block)(stock_x)
    (stock_grad,) = torch.autograd.grad(stock_y, [stock_x], torch.ones_like(stock_y))
    error = ((grad_x - stock_grad).norm() / stock_grad.norm()).item()
    assert error < 1e-3, (precision, error)
    print("step right", precision, error, flush=True)
"""

# torch's log lines: level letter, month and day, time ("E1201 12:34:56.789000 ...")
TORCH_WARNING_OR_ERROR = re.compile(r"[WE]\d{4} \d\d:\d\d:\d\d")


def test_a_cold_float32_compile_logs_no_warning_or_error(tmp_path):
    environment = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                       TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
                       VITATTN_BWD_COMPILE_MODE="max-autotune",
                       PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    environment.pop("VITATTN_BWD_CACHE", None)        # our cache would point Inductor elsewhere
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, cwd=tmp_path,
                            capture_output=True, text=True, timeout=570)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("step right") == 2, result.stdout
    logged = [line for line in result.stderr.splitlines()
              if TORCH_WARNING_OR_ERROR.match(line)]
    assert not logged, "\n".join(logged[:20])
