"""SHA-256 of the sm_90 SASS of every warp-specialized pass configuration (both q layouts)."""
import hashlib
import re
import sys
sys.path.insert(0, "scripts")
from vitattn_bwd import attention_bwd_ws as w
from kernel_resources import ptxas_report_and_sass
for rows, configs in ((True, w.ROWS_WS_TILES), (False, w.COLS_WS_TILES)):
    for t in configs:
        for hir in (True, False):
            c = w.compile_pass_ws_sm90(t, rows, heads_in_rows=hir)
            _, sass = ptxas_report_and_sass(c)
            body = "\n".join(re.sub(r"/\*[0-9a-f]{4}\*/", "", line).split("/*")[0]
                             for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line))
            print(rows, tuple(t), hir, hashlib.sha256(body.encode()).hexdigest()[:16], flush=True)
