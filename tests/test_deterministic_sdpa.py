"""deterministic_sdpa's operators where no GPU runs them: the shapes and dtypes their
fake implementations promise (what torch.compile traces with), and where they run."""
import torch

from vitattn_bwd import deterministic_sdpa

BATCH, SEQ, HEADS, HEAD_DIM = 2, 17, 4, 64
EMBED = HEADS * HEAD_DIM


def test_fake_shapes_and_dtypes():
    qkv = torch.empty(BATCH, SEQ, 3 * EMBED, dtype=torch.bfloat16, device="meta")
    attn, lse = torch.ops.vitattn_bwd.sdpa_ws_fwd(qkv, HEADS)
    assert attn.shape == (BATCH, SEQ, EMBED) and attn.dtype == torch.bfloat16
    assert lse.shape == (BATCH, HEADS, SEQ) and lse.dtype == torch.float32
    grad_qkv = torch.ops.vitattn_bwd.sdpa_ws_bwd(attn, qkv, attn, lse, HEADS)
    assert grad_qkv.shape == qkv.shape and grad_qkv.dtype == torch.bfloat16


def test_supported_on_hopper_only_in_half_dtypes_at_head_dim_64():
    cpu = torch.device("cpu")
    assert not deterministic_sdpa.supported(cpu, torch.bfloat16, 64)
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert deterministic_sdpa.supported(cuda, torch.bfloat16, 64) == hopper
    assert not deterministic_sdpa.supported(cuda, torch.float32, 64)
    assert not deterministic_sdpa.supported(cuda, torch.bfloat16, 72)
