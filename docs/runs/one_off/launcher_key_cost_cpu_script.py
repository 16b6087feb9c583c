"""What launcher.launch adds to each cached launch on a CPU core: the checks that keep
the JIT path, the cache key and its lookup, for the package's four Gluon launches as
their launchers make them on CPU tensors (tests/test_launcher._launches, recorded, not
launched), with triton's driver replaced by a stand-in (no GPU here). Median of 5
rounds of 20,000 calls each. Run from the repository root."""
import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.test_launcher import StandInDrivers, _launches  # noqa: E402
from vitattn_bwd import launcher  # noqa: E402

launcher.driver = StandInDrivers
for kernel, args, kwargs in _launches():
    key = launcher._cache_key(kernel, args, kwargs)
    table = {key: None}

    def cached_part():
        launcher._jit_path_only(kernel, (1,))
        table.get(launcher._cache_key(kernel, args, kwargs))
        launcher._globals_unchanged(kernel)
    calls = 20000
    rounds = [timeit.timeit(cached_part, number=calls) / calls * 1e6 for _ in range(5)]
    print(f"{kernel.__name__:26s} {len(args):2d} arguments: {statistics.median(rounds):.2f} us "
          f"a launch")
