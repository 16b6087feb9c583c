"""The one-off selector of core_ws_s24_run1: scripts/time_core_ws.py over the rotated
walk (FASTEST_TILES) and its variants with k and v given back to the producer within the
item's last tile (early_kv_release) and the row statistics loaded a step ahead
(prefetch_stats) or by TMA with q and dO (stats_in_ring); run from the repository root with PYTHONPATH=."""
import sys
sys.path.insert(0, "scripts")
from vitattn_bwd import attention_bwd_ws as ws
base = ws.FASTEST_TILES
ws.TILES = ()
ws.CANDIDATE_TILES = (base, base._replace(early_kv_release=True),
                      base._replace(prefetch_stats=True),
                      base._replace(stats_in_ring=True),
                      base._replace(early_kv_release=True, stats_in_ring=True))
import time_core_ws  # noqa: E402
sys.argv = ["time_core_ws.py", "--batch", "32"] + sys.argv[1:]
time_core_ws.main()
