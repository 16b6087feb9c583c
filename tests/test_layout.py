"""layout.py: heads split from a QKV projection and merged back, as views where they
can be."""
import pytest
import torch

from vitattn_bwd.layout import merge_heads, qkv_heads, split_heads


def test_qkv_heads_are_views_of_the_projection_at_its_q_k_v_columns():
    B, S, H, D = 2, 5, 4, 8
    qkv = torch.randn(B, S, 3 * H * D)
    parts = qkv_heads(qkv, H)
    for index, part in enumerate(parts):
        columns = qkv[..., index * H * D:(index + 1) * H * D]                   # [B,S,E]
        assert part.shape == (B, H, S, D)
        assert torch.equal(part, columns.reshape(B, S, H, D).transpose(1, 2))
        assert part.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        assert part.stride() == (S * 3 * H * D, D, 3 * H * D, 1)
        assert torch.equal(merge_heads(part), columns)


def test_split_and_merge_heads_round_trip():
    t = torch.randn(3, 7, 24)
    assert torch.equal(merge_heads(split_heads(t, 6)), t)
    assert split_heads(t, 6)[1, 2, 4].tolist() == t[1, 4, 8:12].tolist()


@pytest.mark.parametrize("shape", [(2, 5, 50), (2, 5, 48, 1)], ids=["width", "rank"])
def test_a_projection_of_another_shape_is_refused_naming_qkv(shape):
    with pytest.raises(ValueError, match=r"qkv must be \[B, S, 3 \* num_heads \* D\]"):
        qkv_heads(torch.zeros(shape), 4)
