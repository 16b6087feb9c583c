"""A stand-in until scripts/profile_host.py imports harness: module_step moved to
harness.py, and the kernel profile to `time_kernels.py --kernel contract`. Delete this
file when profile_host.py takes module_step from harness."""
from harness import module_step  # noqa: F401
