"""vitattn_bwd: the fused backward of a pre-LayerNorm ViT attention block.

Importing changes no process state: a compile cache named by VITATTN_BWD_CACHE is loaded
at the first compile (cache.load_env_cache_once), not here."""
from .api import BlockGrads, attention_block_backward
from .cache import load_compile_cache
from .module import VisionAttentionBlock

__all__ = ["BlockGrads", "VisionAttentionBlock", "attention_block_backward",
           "load_compile_cache"]
