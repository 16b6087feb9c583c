"""The README's Python blocks run as written, and the README stays a user's page.

A ```python block preceded by `<!-- runs on cpu -->` (or `<!-- runs on cpu, needs
transformers -->`: skipped where that module is not installed) is executed as a script in
a fresh process, as a user would paste it: on the CPU (CUDA hidden, no Triton
interpreter flag) and, in the gpu-marked twin, on the GPU. Each ends by printing one line,
"checked: ...", saying what it checked: a block passes only where that line came out."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

MARKER = re.compile(r"<!-- runs on cpu(?:, needs ([\w.]+(?:, [\w.]+)*))? -->\n```python\n"
                    r"(.*?)```", re.S)


def marked_blocks(text):
    """[(line number, needed modules, code)] of the marked blocks of `text`."""
    return [(text.count("\n", 0, m.start()) + 1,
             m.group(1).split(", ") if m.group(1) else [], m.group(2))
            for m in MARKER.finditer(text)]


BLOCKS = marked_blocks(README.read_text())


def run_block(code, needs, env_changes, timeout):
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the block needs {module}, which is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"README block failed (rc {result.returncode}):\n{code}\n--- stderr ---\n"
        f"{result.stderr[-4000:]}")
    lines = result.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("checked: "), result.stdout[-2000:]


def test_the_readme_has_its_three_quick_starts_marked():
    codes = [code for _, _, code in BLOCKS]
    assert len(BLOCKS) == 3
    assert any("attention_block_backward" in c and "contract.run" in c for c in codes)
    assert any("VisionAttentionBlock" in c for c in codes)
    assert any("swap_attention" in c for c in codes)
    assert all(c.count('print("checked: ') == 1 for c in codes)


@pytest.mark.parametrize("line,needs,code", BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_readme_block_runs_on_cpu(line, needs, code):
    run_block(code, needs, {"CUDA_VISIBLE_DEVICES": ""}, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("line,needs,code", BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_readme_block_runs_on_gpu(line, needs, code):
    run_block(code, needs, {}, timeout=1200)


def test_readme_is_a_users_page():
    """At most 200 lines; no work-log pointers (version tags, sessions, issue numbers,
    commit hashes); every relative link resolves."""
    text = README.read_text()
    assert text.count("\n") <= 200
    for pattern in (r"\bv\d{1,2}\b", r"\bsession \d", r"\bissues? \d", r"#\d{2,}",
                    r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"):
        found = re.findall(pattern, text, re.I)
        assert not found, f"README contains {found} ({pattern})"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to missing {target}"
