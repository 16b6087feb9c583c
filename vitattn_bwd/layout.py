"""Tensor layouts shared by every layer of the package: heads split and merged, and the
names of the two LayerNorm gradient modes. Neutral ground: imports nothing of ours."""

LN_GRAD_MODES = ("exact", "contract")


def split_heads(t, num_heads):
    """[B,S,E] -> [B,H,S,D] (a view)"""
    B, S, E = t.shape
    return t.view(B, S, num_heads, E // num_heads).transpose(1, 2)


def qkv_heads(qkv, num_heads):
    """A QKV projection [B,S,3E] (q | k | v columns) -> q, k, v [B,H,S,D] (views)"""
    return tuple(split_heads(t, num_heads) for t in qkv.chunk(3, dim=-1))


def merge_heads(t):
    """[B,H,S,D] -> [B,S,E]"""
    B, H, S, D = t.shape
    return t.transpose(1, 2).reshape(B, S, H * D)
