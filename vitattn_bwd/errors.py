"""Errors as the caller expects them: an out-of-memory anywhere in our calls, also inside
Inductor's compile and autotuning (where it arrives wrapped: InductorError,
BackendCompilerFailed, LoweringException) and inside the C++ wrapper that launches a CUDA
graph's kernels (where it arrives as a failed allocation call), reaches the caller as
torch.OutOfMemoryError, chained to what was raised, so that `except
torch.OutOfMemoryError` catches it. Not reached on CUDA with torch 2.11: there a failed
allocation inside the C++ wrapper crashed the process (docs/testing.md)."""
import functools

import torch

# What Inductor's C++ wrapper (graph.CPP_WRAPPER_DEVICES) raises when a buffer cannot be
# allocated: "aoti_torch_empty_strided(...) API call failed at ..."; the allocator's own
# error (CUDA out of memory) goes only to the log.
CPP_WRAPPER_ALLOCATION = "aoti_torch_empty_strided("


def _chain(error):
    """error and every exception it wraps: causes, contexts, Inductor's inner_exception."""
    seen, pending = [], [error]
    while pending:
        current = pending.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        pending += [current.__cause__, current.__context__,
                    getattr(current, "inner_exception", None)]
    return seen


def out_of_memory_in(error):
    """The device out-of-memory behind `error`, or None: a torch.OutOfMemoryError in its
    chain, one whose message Inductor copied into a new exception ("CUDA out of
    memory"), or the C++ wrapper's failed allocation. A kernel's shared memory or
    registers running out (triton's OutOfResources) is not device memory and is not
    one."""
    chain = _chain(error)
    return next((e for e in chain if isinstance(e, torch.OutOfMemoryError)),
                next((e for e in chain if "CUDA out of memory" in str(e)
                      or CPP_WRAPPER_ALLOCATION in str(e)), None))


def out_of_memory_as_such(fn):
    """fn, with a device out-of-memory beneath any exception it raises re-raised as
    torch.OutOfMemoryError (chained to that exception); other exceptions unchanged."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            cause = out_of_memory_in(error)
            if cause is None:
                raise
            message = str(cause)
            if CPP_WRAPPER_ALLOCATION in message:
                message = f"out of memory: a compiled graph could not allocate a buffer ({message})"
            raise torch.OutOfMemoryError(message) from error
    return wrapper
