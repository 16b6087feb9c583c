"""Our compiled graphs replayed as CUDA graphs, on any thread.

The smallest batches are launch-bound: their GPU work is shorter than launching their
kernels one by one. `GraphedCall` wraps a compiled function: the first call with a new
input signature (shapes, strides, dtypes, device) runs it (compiling if need be), then
captures one CUDA graph of it on static copies of those inputs and replays it; every
call copies its inputs into the static buffers, replays, and copies its outputs out.
Nothing is compiled or allocated after capture, so every replay launches the same
kernels. A call made while the caller itself captures (torch.compile's "reduce-overhead",
a torch.cuda.graph block) runs the function directly, so that its kernels join the
caller's graph; so does a first call made while another pool takes the thread's
allocations (the warm-up of torch.compile's CUDA graph trees), captured at a later call.

Not Inductor's CUDA graph trees: their state and memory pool are per device and shared
by every thread, and torch 2.11 neither serializes their capture across threads nor sets
them up outside the thread that first imported them (pytorch issues 113809, 123177), so
they cannot run on autograd's worker thread, where VisionAttentionBlock's backward runs.
A plain torch.cuda.CUDAGraph is captured in thread-local mode with a private pool, and
its replays are serialized by a lock and ordered on the GPU by an event.
"""
import contextlib
import threading
import warnings

import torch


def static_buffers(inputs):
    """Tensors to capture a graph on: like `inputs` in type (nn.Parameter or not), shape,
    strides, dtype, device and requires_grad (what dynamo's guards check, so fn runs the
    graph it compiled for the caller's tensors: a plain copy of a module's weight made
    dynamo compile a second graph, with autotuning of its own), holding copies of their
    values. Never inference tensors, even when made inside torch.inference_mode (an
    inference tensor could not be copied into by a later call outside it)."""
    with torch.inference_mode(False), torch.no_grad():
        static = {}
        for name, t in inputs.items():
            copy = _empty_like_strided(t).copy_(t)
            static[name] = (torch.nn.Parameter(copy, requires_grad=t.requires_grad)
                            if isinstance(t, torch.nn.Parameter)
                            else copy.requires_grad_(t.requires_grad))
        return static


class _Captured:
    """One CUDA graph with its static inputs and outputs."""

    def __init__(self, fn, inputs):
        self.inputs = static_buffers(inputs)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # one run on the static buffers first, on the capture's stream: whatever
            # their differences from the caller's tensors (no aliasing, other addresses)
            # or the new stream would make fn compile or initialize is done here, not
            # during the capture
            fn(**self.inputs)
            side.synchronize()
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.outputs = fn(**self.inputs)
            except BaseException:
                try:
                    self.graph.capture_end()
                except Exception:                      # the capture is invalid anyway
                    pass
                raise
            self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.done = None                               # event after the last replay

    def replay(self, inputs):
        stream = torch.cuda.current_stream()
        if self.done is not None:
            stream.wait_event(self.done)               # an earlier replay, any stream
        with torch.no_grad():                          # static inputs may require grad
            torch._foreach_copy_([self.inputs[name] for name in inputs],
                                 list(inputs.values()))
        self.graph.replay()
        outputs = [_empty_like_strided(t) for t in self.outputs]
        torch._foreach_copy_(outputs, list(self.outputs))
        self.done = stream.record_event()
        return tuple(outputs)


def _empty_like_strided(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _signature(inputs):
    return tuple((name, t.shape, t.stride(), t.dtype, t.device)
                 for name, t in inputs.items())


class GraphedCall:
    """fn(**tensors) -> tuple of tensors, replayed as one CUDA graph per input signature.
    fn must be deterministic in which kernels it launches for a signature (our compiled
    graphs are) and must not keep references to its inputs or outputs; all inputs on one
    GPU.

    The first call of a signature runs fn directly (compiling, autotuning; an error
    there reaches the caller), then captures, and returns the first replay's outputs:
    every call of a signature returns the graph's bits. A call made while the current
    stream is capturing (the caller's CUDA graph) runs fn directly, so fn must not
    compile there (a capture allows no compile): a compiled fn must have met the same
    kinds of inputs outside the capture.

    `pool_taken(device_index)` says whether another memory pool takes this thread's
    allocations on that GPU (Inductor's CUDA graph trees warming up). A capture then
    would leave its static inputs and graph memory in that pool, which must hold only
    what its owner tracks: a signature met there (new, or stale as below) runs fn
    directly, and is captured at its next call outside.

    `holds_compiled`, for a compiled fn, says whether dynamo holds fn's compiled graphs.
    torch._dynamo.reset() drops them but not the graphs captured here: replays alone
    would leave fn uncompiled until a run inside the caller's capture (torch.compile's
    "reduce-overhead" records after one warm-up run), where compiling fails the
    capture. So where holds_compiled() turns False, every signature captured before is
    captured again at its next call (fn compiled again outside any capture), and
    replays the kernels that fn's direct runs now launch. (Where it is False from the
    start, dynamo compiles nothing, as under torch.compiler.set_stance("force_eager"),
    and nothing is captured again.)

    One lock per instance serializes calls, the first (compiling, autotuning) one
    included. If a capture fails, that signature runs fn directly from then on, with a
    warning: correct, only slower. Each captured signature keeps its static inputs and
    its graph's memory pool (about the call's inputs and intermediates) for the life of
    the instance."""

    def __init__(self, fn, holds_compiled=lambda: True, pool_taken=lambda device_index: False):
        self.fn = fn
        self._holds_compiled = holds_compiled
        self._pool_taken = pool_taken
        self._graphs = {}              # signature -> _Captured, or None: runs directly
        self._held = None              # holds_compiled() after the last capture or look
        self._stale = set()            # signatures captured before fn's graphs were dropped
        self._lock = threading.Lock()

    def __call__(self, **inputs):
        if torch.cuda.is_current_stream_capturing():
            # inside the caller's own capture (torch.compile's CUDA graphs, a
            # torch.cuda.graph block): fn's kernels become part of the caller's graph;
            # a capture of our own cannot begin there, nor a replay run inside it
            return tuple(self.fn(**inputs))
        key = _signature(inputs)
        device = next(iter(inputs.values())).device
        # entering torch.cuda.device costs more host time than the check
        on_device = (contextlib.nullcontext() if device.index == torch.cuda.current_device()
                     else torch.cuda.device(device))
        with self._lock, on_device:
            captured = self._graphs.get(key)
            if key in self._graphs:
                if captured is None:
                    return tuple(self.fn(**inputs))
                if not self._is_stale(key):
                    return captured.replay(inputs)
            if self._pool_taken(device.index):
                return tuple(self.fn(**inputs))        # captured at a call outside
            if captured is not None:                   # stale
                if captured.done is not None:
                    captured.done.synchronize()        # its last replay, before it goes
                del self._graphs[key]
                self._stale.discard(key)
                outputs = None
            else:
                outputs = tuple(self.fn(**inputs))     # compiles, autotunes
            try:
                captured = _Captured(self.fn, inputs)  # compiles again after a reset
            except Exception as error:                 # e.g. an op that cannot be captured
                warnings.warn(f"vitattn_bwd: CUDA graph capture failed ({error!r}); these "
                              "input shapes run without a CUDA graph", RuntimeWarning)
                self._graphs[key] = None
                return outputs if outputs is not None else tuple(self.fn(**inputs))
            self._graphs[key] = captured
            self._held = self._holds_compiled()
            # the first call returns the graph's outputs too, so that every call of a
            # signature gives the same bits as its later replays
            return captured.replay(inputs)

    def _is_stale(self, key):
        """Whether fn's compiled graphs were dropped since `key` was captured: a turn of
        holds_compiled() from True to False marks every captured signature stale."""
        held = self._holds_compiled()
        if self._held and not held:
            self._stale.update(k for k, c in self._graphs.items() if c is not None)
        self._held = held
        return key in self._stale
