"""Errors as the caller expects them: an out-of-memory anywhere in our calls, also inside
Inductor's compile and autotuning (where it arrives wrapped: InductorError,
BackendCompilerFailed, LoweringException), reaches the caller as torch.OutOfMemoryError,
chained to what was raised, so that `except torch.OutOfMemoryError` catches it."""
import functools

import torch


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
    chain, or one whose message Inductor copied into a new exception ("CUDA out of
    memory"). A kernel's shared memory or registers running out (triton's
    OutOfResources) is not device memory and is not one."""
    chain = _chain(error)
    return next((e for e in chain if isinstance(e, torch.OutOfMemoryError)),
                next((e for e in chain if "CUDA out of memory" in str(e)), None))


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
            raise torch.OutOfMemoryError(str(cause)) from error
    return wrapper
