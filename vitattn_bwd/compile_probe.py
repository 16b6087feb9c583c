"""Whether a family of Gluon kernels runs with the installed triton, decided by compiling
it once: Gluon's API moves between triton releases, and a kernel file that imports may
still not compile. Imports nothing of ours (the probes import the kernels)."""
import warnings


def compile_failure(probe, kernels, fallback):
    """None where probe() returns (it compiles the kernels, launching nothing), else why
    not, in one line, after a RuntimeWarning: "vitattn_bwd: {kernels} do not compile
    with triton X (why); {fallback}". Any exception counts: the caller falls back."""
    try:
        probe()
    except Exception as error:
        import triton
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[-1] if lines else ''}"
        warnings.warn(f"vitattn_bwd: {kernels} do not compile with triton "
                      f"{triton.__version__} ({reason}); {fallback}", RuntimeWarning,
                      stacklevel=3)
        return reason
    return None
