"""vitattn_bwd: the fused backward of a pre-LayerNorm ViT attention block."""
import os

from .api import BlockGrads, attention_block_backward
from .cache import CACHE_ENV, load_compile_cache
from .module import VisionAttentionBlock

__all__ = ["BlockGrads", "VisionAttentionBlock", "attention_block_backward",
           "load_compile_cache"]

if os.environ.get(CACHE_ENV):                 # a warm-up run's cache, for this process
    load_compile_cache(os.environ[CACHE_ENV])
