# ruff: noqa  (an archived one-off: how ncu_ws_s24_base.txt's phase table was made)
"""Warp-stall samples of the warp-specialized kernel's consumer warps by phase of a
tile, from ncu's per-instruction source page:
    ncu -i REPORT --page source --csv --print-source sass > sass.csv
    python3 ncu_ws_phases_script.py sass.csv
The phase boundaries are SASS addresses (last 5 hex digits) read off that one report's
listing (the consumers' partition begins after USETMAXREG.TRY_ALLOC 0xf0)."""
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
header, data = rows[1], rows[2:]
column = {h: i for i, h in enumerate(header)}
SAMPLES = "Warp Stall Sampling (All Samples)"
PHASES = [("item start", 0xbf070, 0xc0160), ("tile start .. S wait", 0xc0160, 0xc03e0),
          ("softmax exp", 0xc03e0, 0xc1130), ("slot release, P store, barrier", 0xc1130, 0xc1720),
          ("dV issue, dP wait", 0xc1720, 0xc19a0), ("dS math, store, barrier", 0xc19a0, 0xc2470),
          ("dQ, dK issue, dQ wait", 0xc2470, 0xc2730), ("dQ hand-over", 0xc2730, 0xc2960),
          ("epilogue: dK, dV stores", 0xc2960, 0xc3320)]
def samples(lo, hi):
    return sum(int(r[column[SAMPLES]] or 0) for r in data if lo <= int(r[0], 16) & 0xfffff < hi)
total = samples(0xbf070, 0xc3320)
for name, lo, hi in PHASES:
    print(f"{name:32} {samples(lo, hi):6} {samples(lo, hi) / total:6.1%}")
