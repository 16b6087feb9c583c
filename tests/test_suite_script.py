"""scripts/gpu_suite.sh names only tests that exist: its serial and slow parts list
files and single tests by path, which a rename would otherwise leave running nothing
(the xdist part runs every other gpu test, so a missing name there drops nothing)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _listed():
    script = (ROOT / "scripts" / "gpu_suite.sh").read_text()
    arrays = re.findall(r"^(SERIAL|SLOW)=\(([^)]*)\)", script, flags=re.M)
    assert {name for name, _ in arrays} == {"SERIAL", "SLOW"}
    return [entry for _, body in arrays for entry in body.split()]


def test_every_test_the_script_names_exists():
    listed = _listed()
    assert listed
    for entry in listed:
        path, _, test = entry.partition("::")
        source = (ROOT / path).read_text()
        assert path.startswith("tests/test_gpu"), entry
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", source, flags=re.M), entry
