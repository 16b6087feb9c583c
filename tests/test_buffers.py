"""buffers.output_buffer: not NaN-filled under torch.use_deterministic_algorithms(True),
and the launchers that take their outputs from it write every element they return."""
import math

import torch

from vitattn_bwd import attention_fwd, buffers, softmax_bwd, split_gemm


def test_output_buffer_is_not_nan_filled_under_the_deterministic_flag(deterministic):
    like = torch.zeros(3, dtype=torch.float16)
    assert torch.isnan(like.new_empty(4096, 8)).all()            # what torch does
    buffer = buffers.output_buffer(like, 4096, 8, dtype=torch.float32)
    assert buffer.shape == (4096, 8) and buffer.dtype == torch.float32
    assert buffer.is_contiguous() and buffer.device == like.device
    assert not torch.isnan(buffer).all()
    assert buffers.output_buffer(like, 2, 3).dtype == torch.float16


def test_output_buffer_without_the_flag_is_new_empty(monkeypatch):
    """Without the flag: like.new_empty itself (no new storage of its own)."""
    calls = []
    original = torch.Tensor.new_empty

    def recorded(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "new_empty", recorded)
    like = torch.zeros(3)
    buffer = buffers.output_buffer(like, 5, 0, 2, dtype=torch.bfloat16)
    assert buffer.shape == (5, 0, 2) and buffer.dtype == torch.bfloat16
    assert calls == [((5, 0, 2),)]


def _launch_all():
    """Every launcher that takes its outputs from output_buffer, on small inputs (the
    attention core at a partial tile of 21 tokens, P given and recomputed)."""
    g = torch.Generator().manual_seed(3)
    B, H, S, D = 2, 2, 21, 16
    P = torch.softmax(torch.randn(B, H, S, S, generator=g), dim=-1)
    grad_attn = torch.randn(B, S, H * D, generator=g)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    scale = 1 / math.sqrt(D)
    attn_output, lse = attention_fwd.launch_attention_fwd(q, k, v, scale)
    outputs = [attn_output, lse]
    for given, output in ((dict(probs=P), None), (dict(lse=lse), attn_output)):
        rows = softmax_bwd.launch_rows(grad_attn, q, k, v, output, scale, **given)
        outputs += [*rows, *softmax_bwd.launch_cols(grad_attn, q, k, v, rows[2], scale,
                                                    **given)]
    a, b = split_gemm.fp16_halves(torch.randn(37, 70, generator=g)), \
        split_gemm.fp16_halves(torch.randn(70, 45, generator=g))
    outputs.append(split_gemm.launch(a.hi, a.lo, b.hi, b.lo, split_gemm.unscale_of(a, b)))
    return outputs


def test_launchers_write_every_element_they_return(triton_interpreter, monkeypatch):
    """With output_buffer's tensors filled with NaN and then with zeros before the
    kernels run, the outputs are the same bits: no element is returned, or read,
    without a kernel having written it."""
    results = []
    for fill in (float("nan"), 0.0):
        monkeypatch.setattr(buffers, "output_buffer",
                            lambda like, *shape, dtype=None, fill=fill: torch.full(
                                shape, fill, dtype=like.dtype if dtype is None else dtype))
        results.append(_launch_all())
    for poisoned, zeroed in zip(*results):
        assert torch.equal(poisoned, zeroed)
