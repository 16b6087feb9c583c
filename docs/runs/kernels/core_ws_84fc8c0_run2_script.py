"""The one-off selector of core_ws_84fc8c0_run2: scripts/time_core_ws.py over these
configurations only (run from the repository root with PYTHONPATH=.). run1 timed, with
the same script, (128, 128, 2, 168, 40, 0, persistent, 1, True, grad_q_buffers,
rotated) for (persistent, grad_q_buffers, rotated) in (T, 1, F), (T, 2, F), (F, 2, F),
(T, 2, F) with the 128-byte swizzle, (T, 1, F) at 3 stages, (T, 2, T), (T, 1, T) at 3
stages, and FASTEST_TILES of the code before (64, 128, 3, 168, 56, 128, True)."""
import sys
sys.path.insert(0, "scripts")
from vitattn_bwd import attention_bwd_ws as ws
W = ws.WsTiles
ws.TILES = ()
ws.CANDIDATE_TILES = (
    W(128, 128, 2, 168, 40, 0, True, 1, True, 2, True),
    W(128, 128, 2, 168, 40, 128, True, 1, True, 2, True),
    W(128, 128, 2, 168, 40, 128, True, 1, True, 1, True),
    W(128, 128, 2, 168, 48, 128, True, 1, True, 2, True),
)
import time_core_ws  # noqa: E402
sys.argv = ["time_core_ws.py", "--batch", "32"]
time_core_ws.main()
