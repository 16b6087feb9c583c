"""vitattn_bwd: the fused backward of a pre-LayerNorm ViT attention block."""
from .api import BlockGrads, attention_block_backward

__all__ = ["BlockGrads", "attention_block_backward"]
from .module import VisionAttentionBlock  # noqa: E402

__all__ += ["VisionAttentionBlock"]
