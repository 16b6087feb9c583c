"""The one-off selector of core_ws_s24_run3: scripts/time_core_ws.py over FASTEST_TILES
(dK and dV stored through shared memory, the log-sum-exp scaled by the delta kernel: run
2's two gains, now the kernel's only form) and its variants: each dQ tile stored for
the writer at once but handed over at the next tile's first barrier (deferred_grad_q;
ncu had the consumers 22% of their samples in the hand-over, its fence and barrier),
and the dQ tiles in shared memory with a 128- or 64-byte swizzle (grad_q_swizzle;
unswizzled, ncu counted 8-way bank conflicts on their stores), with two stages and two
dQ buffers or three and one. Run from the repository root with PYTHONPATH=."""
import sys
sys.path.insert(0, "scripts")
from vitattn_bwd import attention_bwd_ws as ws
base = ws.FASTEST_TILES
ws.TILES = ()
ws.CANDIDATE_TILES = (base, base._replace(deferred_grad_q=True),
                      base._replace(grad_q_swizzle=128),
                      base._replace(grad_q_swizzle=128, deferred_grad_q=True),
                      base._replace(grad_q_swizzle=64, deferred_grad_q=True),
                      base._replace(deferred_grad_q=True, grad_q_buffers=1, num_stages=3))
import time_core_ws  # noqa: E402
sys.argv = ["time_core_ws.py", "--batch", "32"] + sys.argv[1:]
time_core_ws.main()
