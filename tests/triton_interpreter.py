"""Triton's CPU interpreter (TRITON_INTERPRET=1) keeps bf16 values as raw uint16 and its
tl.dot multiplies those integers (seen with triton 3.6 and 3.9). Products of bf16 values
are exact in float32, so upcasting the operands first reproduces the GPU's arithmetic."""
import numpy as np


def patch_bf16_dot():
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_upcasts_bf16", False):
        return
    original = builder.create_dot

    def upcast(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    create_dot._upcasts_bf16 = True
    builder.create_dot = create_dot
