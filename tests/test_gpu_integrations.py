"""On a CUDA GPU (gpu marker), against the real libraries: vitattn_bwd.integrations.
swap_attention on a timm `vit_large_patch14_clip_336` and an OpenCLIP ViT-L/14-336 vision
tower (577 tokens, 1024 wide, 16 heads; 2 blocks, random init, no download), each
against its stock model and a float64 copy: outputs and gradients, 5 AdamW steps, the
state_dict round trip (a swapped checkpoint loads into the stock model and back), the
library's own machinery (timm: gradient checkpointing, forward_intermediates; OpenCLIP: a
CLIP model whose text tower stays stock, the seq-first Transformer), and a step under
torch.autocast. Skipped where timm / open_clip is not installed
(tests/test_integrations.py covers the same swap on the CPU with stand-ins).

float32 with TF32 off for torch's own matmuls and convolutions (set per test and
restored). Bounds as tests/test_gpu_module.py's Hugging Face tower: the output 1e-5
against float64, each gradient 2e-4 (one fused backward's 1e-4 plus what the block above
hands down), the QKV weights 1e-3 (one fp16 product, as the contract allows).
"""
import copy
import inspect

import pytest
import torch

from vitattn_bwd.integrations import swap_attention, swapped_layers, unswap_attention

from .helpers import adamw_losses, relative_errors, update_difference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

DEVICE = "cuda"
IMAGE, PATCH, EMBED, HEADS, LAYERS, BATCH = 336, 14, 1024, 16, 2, 2
SEQ = (IMAGE // PATCH) ** 2 + 1                   # 577


def _perturb(model, scale=0.1):
    """LayerNorm weights, biases and LayerScale gammas off their constant inits."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, device=DEVICE, generator=g) * scale)
    return model


def _bound(name):
    if name.endswith(("qkv.weight", "in_proj_weight")):
        return 1e-3
    return 2e-4


def _grad_errors(got, want):
    return {n: ((g.double() - want[n].double()).norm() / want[n].double().norm()).item()
            for n, g in got.items()}


def _batch(seed, tokens):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, device=DEVICE, generator=g)
    weight = torch.randn(BATCH, tokens, EMBED, device=DEVICE, generator=g)
    return pixels, weight


# --------------------------------------------------------------------------------------
# timm
# --------------------------------------------------------------------------------------
def _timm_pair(**kwargs):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    stock = timm.create_model("vit_large_patch14_clip_336", pretrained=False,
                              img_size=IMAGE, patch_size=PATCH, embed_dim=EMBED,
                              num_heads=HEADS, depth=LAYERS, num_classes=0, **kwargs)
    stock = _perturb(stock.to(DEVICE).eval())
    ours = swap_attention(copy.deepcopy(stock))
    assert swapped_layers(ours) == [f"blocks.{i}" for i in range(LAYERS)]
    from timm.models.vision_transformer import Block
    assert all(isinstance(b, Block) and type(b) is not Block for b in ours.blocks)
    return stock, ours


def _timm_loss(model, pixels, weight):
    tokens = model.forward_features(pixels.to(next(model.parameters()).dtype))
    pooled = model.forward_head(tokens, pre_logits=True)
    return (tokens * weight.to(tokens.dtype)).sum() + pooled.pow(2).sum(), tokens


def _grads(loss_fn, model, pixels, weight):
    model.zero_grad(set_to_none=True)
    loss, out = loss_fn(model, pixels, weight)
    loss.backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def _check_against_float64(loss_fn, stock, ours, tokens):
    stock64 = copy.deepcopy(stock).double()
    pixels, weight = _batch(0, tokens)
    out64, grads64 = _grads(loss_fn, stock64, pixels.double(), weight.double())
    out_stock, grads_stock = _grads(loss_fn, stock, pixels, weight)
    out_ours, grads_ours = _grads(loss_fn, ours, pixels, weight)
    ours_err, stock_err = relative_errors([out_ours, out_stock], [out64, out64])
    print(f"output vs float64: ours {ours_err:.2e}, stock {stock_err:.2e}")
    assert ours_err < 1e-5 and stock_err < 1e-5, (ours_err, stock_err)
    assert grads_ours.keys() == grads_stock.keys() == grads64.keys()
    errors, stock_errors = _grad_errors(grads_ours, grads64), _grad_errors(grads_stock,
                                                                          grads64)
    report = {n: f"{errors[n]:.1e} (stock {stock_errors[n]:.1e})" for n in errors
              if "blocks.0." in n}                   # the first block's, in full
    worst = max(errors, key=errors.get)
    print(f"largest gradient error vs float64: {worst} {errors[worst]:.2e} (stock "
          f"{stock_errors[worst]:.2e})")
    print("gradient errors vs float64:", report)
    for name, err in errors.items():
        assert err < _bound(name), (name, f"{err:.2e}", f"stock {stock_errors[name]:.2e}")
    return grads_ours


@pytest.mark.parametrize("layer_scale", [None, 0.1], ids=["stock_clip", "layerscale"])
def test_timm_vit_l14_336_outputs_and_gradients_against_stock_and_float64(layer_scale):
    stock, ours = _timm_pair(**({} if layer_scale is None else
                                dict(init_values=layer_scale)))
    grads = _check_against_float64(_timm_loss, stock, ours, SEQ)
    if layer_scale is not None:
        assert "blocks.0.ls1.gamma" in grads


def _adamw(loss_of, stock, ours, tokens):
    start = {n: p.detach().clone() for n, p in stock.named_parameters()}
    losses = {key: adamw_losses(model, loss_of, lambda step: _batch(10 + step, tokens), 5,
                                lr=1e-4)
              for key, model in (("stock", stock), ("ours", ours))}
    for a, b in zip(losses["ours"], losses["stock"]):
        assert abs(a - b) <= 1e-4 * abs(b), (losses["ours"], losses["stock"])
    assert losses["ours"][-1] < losses["ours"][0], losses["ours"]
    # as tests/test_gpu_module.py: AdamW's sign-like steps differ where a gradient entry
    # is below its error; a few 1e-4 of the entries, ~0.04 of the update's norm
    rel, diffs = update_difference(ours, stock, start)
    worst = sorted(diffs, key=diffs.get, reverse=True)[:4]
    print(f"AdamW: losses ours {losses['ours']} stock {losses['stock']}; update "
          f"difference {rel:.3e} of the update; largest shares: "
          + ", ".join(f"{n} {diffs[n] / sum(diffs.values()):.0%}" for n in worst))
    assert rel < 0.2, rel


def _timm_regression(model, pixels, weight):
    tokens = model.forward_features(pixels)
    return ((tokens - weight) ** 2).mean() + model.forward_head(
        tokens, pre_logits=True).pow(2).mean()


@pytest.mark.parametrize("layer_scale", [None, 0.1], ids=["stock_clip", "layerscale"])
def test_timm_five_adamw_steps_track_the_stock_model(layer_scale):
    stock, ours = _timm_pair(**({} if layer_scale is None else
                                dict(init_values=layer_scale)))
    _adamw(_timm_regression, stock, ours, SEQ)


def test_timm_state_dict_round_trip_checkpointing_and_intermediates():
    stock, ours = _timm_pair(init_values=0.1)
    assert list(ours.state_dict()) == list(stock.state_dict())
    pixels, weight = _batch(3, SEQ)
    fresh = _timm_pair(init_values=0.1)[0]
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    fresh.load_state_dict(ours.state_dict())               # swapped -> stock, strictly
    for (name, a), b in zip(ours.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    back = swap_attention(copy.deepcopy(fresh))
    back.load_state_dict(fresh.state_dict())              # stock -> swapped
    with torch.no_grad():
        want = stock.forward_features(pixels)
        got = back.forward_features(pixels)
        assert relative_errors([got], [want])[0] < 1e-5
        if hasattr(back, "forward_intermediates"):         # timm's feature API
            inter = back.forward_intermediates(pixels, indices=[0, 1],
                                               intermediates_only=True, output_fmt="NLC")
            stock_inter = stock.forward_intermediates(pixels, indices=[0, 1],
                                                      intermediates_only=True,
                                                      output_fmt="NLC")
            for a, b in zip(inter, stock_inter):
                assert relative_errors([a], [b])[0] < 1e-5
    # gradient checkpointing (checkpoint_seq over the swapped blocks): same gradients
    _, plain = _grads(_timm_loss, back, pixels, weight)
    back.set_grad_checkpointing(True)
    back.train()
    _, checkpointed = _grads(_timm_loss, back, pixels, weight)
    for name, err in _grad_errors(checkpointed, plain).items():
        assert err < 1e-6, (name, err)
    unswap_attention(back)
    assert not swapped_layers(back)


def test_timm_autocast_bfloat16_step():
    """Under autocast the swapped block runs through vision_attention, and so follows
    whatever the module does there; the step completes, gradients are float32."""
    stock, ours = _timm_pair()
    stock64 = copy.deepcopy(stock).double()
    pixels, weight = _batch(4, SEQ)
    with torch.no_grad():
        want = stock64.forward_features(pixels.double())
    outs = {}
    for key, model in (("stock", stock), ("ours", ours)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, out = _timm_loss(model, pixels, weight)
        loss.float().backward()
        outs[key] = relative_errors([out.double()], [want])[0]
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.dtype == torch.float32, name
            assert torch.isfinite(p.grad).all(), name
    print(f"autocast bf16 output vs float64: ours {outs['ours']:.2e}, stock "
          f"{outs['stock']:.2e}")
    assert outs["ours"] < 5e-2


# --------------------------------------------------------------------------------------
# OpenCLIP
# --------------------------------------------------------------------------------------
def _clip_pair():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    stock = open_clip.model.CLIP(
        embed_dim=768,
        vision_cfg=dict(image_size=IMAGE, patch_size=PATCH, width=EMBED, layers=LAYERS,
                        head_width=EMBED // HEADS),
        text_cfg=dict(context_length=16, vocab_size=1000, width=512, heads=8, layers=1))
    stock = _perturb(stock.to(DEVICE).eval())
    stock.visual.output_tokens = True
    ours = swap_attention(copy.deepcopy(stock))
    assert swapped_layers(ours) == [f"visual.transformer.resblocks.{i}"
                                    for i in range(LAYERS)]       # the text tower stays
    from open_clip.transformer import ResidualAttentionBlock
    assert all(isinstance(b, ResidualAttentionBlock) for b in ours.visual.transformer.resblocks)
    return stock, ours


def _clip_loss(model, pixels, weight):
    pooled, tokens = model.visual(pixels.to(next(model.parameters()).dtype))
    return (tokens * weight.to(tokens.dtype)).sum() + pooled.pow(2).sum(), tokens


def test_open_clip_vit_l14_336_outputs_and_gradients_against_stock_and_float64():
    stock, ours = _clip_pair()
    attn = stock.visual.transformer.resblocks[0].attn
    print(f"OpenCLIP block attention: {type(attn).__name__}, batch_first="
          f"{getattr(attn, 'batch_first', True)}")
    _check_against_float64(_clip_loss, stock, ours, SEQ - 1)
    text = torch.randint(0, 1000, (BATCH, 16), device=DEVICE)
    with torch.no_grad():                                  # the stock text tower
        assert relative_errors([ours.encode_text(text)], [stock.encode_text(text)])[0] < 1e-6


def test_open_clip_five_adamw_steps_and_state_dict_round_trip():
    stock, ours = _clip_pair()

    def regression(model, pixels, weight):
        pooled, tokens = model.visual(pixels)
        return ((tokens - weight) ** 2).mean() + pooled.pow(2).mean()
    _adamw(regression, stock, ours, SEQ - 1)
    assert list(ours.state_dict()) == list(stock.state_dict())
    fresh = _clip_pair()[0]
    fresh.load_state_dict(ours.state_dict())               # swapped -> stock
    back = swap_attention(copy.deepcopy(_clip_pair()[0]))
    back.load_state_dict(stock.state_dict())               # stock -> swapped
    pixels, _ = _batch(5, SEQ - 1)
    with torch.no_grad():
        for model, ref in ((fresh, ours), (back, stock)):
            model.eval()
            ref.eval()
            assert relative_errors([model.visual(pixels)[1]], [ref.visual(pixels)[1]])[0] < 1e-5


def test_open_clip_seq_first_transformer():
    """open_clip's Transformer with batch_first=False hands its blocks [S,B,E]."""
    open_clip = pytest.importorskip("open_clip")
    from open_clip.transformer import Transformer
    if "batch_first" not in inspect.signature(Transformer.__init__).parameters:
        pytest.skip("this open_clip's Transformer has no batch_first setting")
    torch.manual_seed(0)
    stock = _perturb(Transformer(EMBED, 1, HEADS, batch_first=False).to(DEVICE).eval())
    assert stock.resblocks[0].attn.batch_first is False
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    assert swapped_layers(ours) == ["resblocks.0"]
    x = torch.randn(BATCH, SEQ, EMBED, device=DEVICE)
    w = torch.randn_like(x)

    def loss_fn(model, x, w):
        out = model(x.to(next(model.parameters()).dtype))
        return (out * w.to(out.dtype)).sum(), out
    stock64 = copy.deepcopy(stock).double()
    out64, g64 = _grads(loss_fn, stock64, x.double(), w.double())
    out, g = _grads(loss_fn, ours, x, w)
    assert relative_errors([out], [out64])[0] < 1e-5
    for name, err in _grad_errors(g, g64).items():
        assert err < _bound(name), (name, err)
    del open_clip


def test_open_clip_autocast_bfloat16_step():
    stock, ours = _clip_pair()
    pixels, weight = _batch(6, SEQ - 1)
    ours.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, out = _clip_loss(ours, pixels, weight)
    loss.float().backward()
    with torch.no_grad():
        want = copy.deepcopy(stock).double().visual(pixels.double())[1]
    err = relative_errors([out.double()], [want])[0]
    print(f"OpenCLIP autocast bf16 output vs float64: ours {err:.2e}")
    assert err < 5e-2
    for name, p in ours.visual.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
