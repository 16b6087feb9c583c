"""The one-off selector of core_ws_s24_run2: scripts/time_core_ws.py over the rotated
walk (FASTEST_TILES) and its variants: the log-sum-exp scaled by the delta kernel, so
that no multiply waits for its load before the first products are issued
(late_lse_scale); k and v given back within the item's last tile (early_kv_release); the
ring slot given back after the P tile's barrier rather than with one of its own
(late_slot_release); dK and dV stored through shared memory in 16-byte rows
(staged_epilogue), last because a fault there ends the process. Run from the repository
root with PYTHONPATH=."""
import sys
sys.path.insert(0, "scripts")
from vitattn_bwd import attention_bwd_ws as ws
base = ws.FASTEST_TILES
three = dict(late_lse_scale=True, early_kv_release=True, late_slot_release=True)
ws.TILES = ()
ws.CANDIDATE_TILES = (base, base._replace(late_lse_scale=True),
                      base._replace(early_kv_release=True),
                      base._replace(late_slot_release=True), base._replace(**three),
                      base._replace(staged_epilogue=True),
                      base._replace(staged_epilogue=True, **three))
import time_core_ws  # noqa: E402
sys.argv = ["time_core_ws.py", "--batch", "32"] + sys.argv[1:]
time_core_ws.main()
