"""The package with torch alone (issue 64 item 2): torch's CPU wheel brings no triton, so
`import vitattn_bwd` and its CPU path must not need it. A fresh process hides triton
behind a meta-path finder that refuses it (as if it were not installed), imports the
package, runs a tiny CPU backward and checks it against the float64 reference (by the
benchmark's tolerance rule and to float32 precision)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Installed before anything else runs: every import of triton or its submodules fails.
HIDE_TRITON = textwrap.dedent("""
    import sys

    class HideTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, HideTriton())
""")

CPU_BACKWARD = textwrap.dedent("""
    import torch
    import vitattn_bwd
    from vitattn_bwd import reference
    from vitattn_bwd.workloads import OUTPUT_NAMES, make_inputs, within_tolerance

    try:
        import triton  # noqa: F401
        raise SystemExit("triton was not hidden")
    except ModuleNotFoundError:
        pass
    inputs = make_inputs(batch=2, seq_len=5, embed_dim=16, num_heads=2)
    ours = vitattn_bwd.attention_block_backward(**inputs, num_heads=2)
    as64 = {k: v.double() if torch.is_tensor(v) else v for k, v in inputs.items()}
    ref = reference.attention_block_backward(*as64.values(), num_heads=2, ln_grad="exact")
    for name, a, b in zip(OUTPUT_NAMES, ours, ref):
        assert within_tolerance(a, b)[0], name      # the benchmark's rule, and float32's
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=name)
    loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
    assert not loaded, loaded
    print("checked without triton:", ", ".join(OUTPUT_NAMES))
""")


def test_the_package_imports_and_runs_its_cpu_backward_without_triton():
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", HIDE_TRITON + CPU_BACKWARD],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checked without triton: grad_x" in run.stdout
