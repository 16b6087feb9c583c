"""vitattn_bwd.integrations.hf on the CPU: a swapped tiny random-init CLIP / SigLIP vision
tower (and a Molmo-style one) against the stock model: outputs, gradients, state_dict,
checkpoints, output_hidden_states, output_attentions, AdamW steps, autocast. Skipped when
transformers is not installed (`pip install -e ".[hf]"`)."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

transformers = pytest.importorskip("transformers")

from transformers import (CLIPConfig, CLIPModel, CLIPVisionConfig,  # noqa: E402
                          CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel)

from vitattn_bwd.integrations import _common, hf  # noqa: E402
from vitattn_bwd.integrations.hf import (swap_attention, swapped_layers,  # noqa: E402
                                         unswap_attention)

from .helpers import adamw_losses, graph_breaks_and_ops, recorded_calls  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_hidden_layers=2, image_size=16, patch_size=8)       # 5 tokens


def _perturb(model, seed=0, scale=0.2):
    """Move every parameter off its init (LayerNorm weights off 1, biases off 0) so that a
    wrong or missing parameter shows in the outputs and gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


def _clip(dtype=torch.float64, config_cls=CLIPVisionConfig, model_cls=CLIPVisionModel,
          **overrides):
    torch.manual_seed(0)
    return _perturb(model_cls(config_cls(**{**TINY, **overrides})).to(dtype).eval())


def _pair(**kwargs):
    stock = _clip(**kwargs)
    return stock, swap_attention(copy.deepcopy(stock))


def _inputs(dtype=torch.float64, batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, 16, 16, generator=g).to(dtype)
    weight = torch.randn(batch, 5, 32, generator=g).to(dtype)
    return pixels, weight


def _loss(model, pixels, weight):
    out = model(pixel_values=pixels)
    return (out.last_hidden_state * weight).sum() + out.pooler_output.pow(2).sum()


def _errors(got, want):
    """Relative error of each named gradient. The keys' bias gets no gradient in exact
    math (softmax ignores a constant added to every key), so its error is measured
    against the norm of the q/k/v bias gradients of its layer."""
    errors = {}
    for name, g in got.items():
        ref = want[name]
        denom = ref.norm()
        if name.endswith("k_proj.bias"):
            layer = name[:-len("k_proj.bias")]
            denom = torch.cat([want[layer + p + "_proj.bias"] for p in "qkv"]).norm()
        errors[name] = ((g.double() - ref.double()).norm() / denom).item()
    return errors


def _grads(model, pixels, weight):
    model.zero_grad(set_to_none=True)
    loss = _loss(model, pixels, weight)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _refused(model, match, **swap_kwargs):
    """swap_attention(model) raises a ValueError matching `match` and swaps no layer."""
    with pytest.raises(ValueError, match=match):
        swap_attention(model, **swap_kwargs)
    assert not swapped_layers(model)


@pytest.fixture
def spy(monkeypatch):
    """x's shape at each call of the fused attention half (proves the swap is in use)."""
    return recorded_calls(monkeypatch, _common, "vision_attention", lambda x, *args: x.shape)


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_outputs_and_gradients_equal_the_stock_model(dtype, bound, spy):
    stock, ours = _pair(dtype=dtype)
    pixels, weight = _inputs(dtype)
    with torch.no_grad():
        want, got = stock(pixel_values=pixels), ours(pixel_values=pixels)
    assert len(spy) == 2                                  # both layers ran fused
    for key in ("last_hidden_state", "pooler_output"):
        err = ((got[key] - want[key]).norm() / want[key].norm()).item()
        assert err < bound, (key, err)
    loss_want, grads_want = _grads(stock, pixels, weight)
    loss_got, grads_got = _grads(ours, pixels, weight)
    torch.testing.assert_close(loss_got, loss_want, rtol=bound, atol=0)
    assert grads_got.keys() == grads_want.keys()
    for name, err in _errors(grads_got, grads_want).items():
        assert err < bound, (name, err)
    assert all(g.dtype == dtype for g in grads_got.values())


def test_state_dict_keys_and_checkpoints_are_stock():
    stock, ours = _pair()
    assert list(ours.state_dict()) == list(stock.state_dict())
    assert swapped_layers(ours) and not swapped_layers(stock)
    pixels, _ = _inputs()
    # a swapped model's weights load into a stock model, strictly, and back
    fresh = _clip()
    _perturb(fresh, seed=5)
    fresh.load_state_dict(ours.state_dict())
    torch.testing.assert_close(fresh(pixel_values=pixels).last_hidden_state,
                               ours(pixel_values=pixels).last_hidden_state,
                               rtol=1e-12, atol=1e-12)
    other = swap_attention(_perturb(_clip(), seed=6))
    other.load_state_dict(stock.state_dict())
    torch.testing.assert_close(other(pixel_values=pixels).last_hidden_state,
                               stock(pixel_values=pixels).last_hidden_state,
                               rtol=1e-12, atol=1e-12)


def test_save_pretrained_from_pretrained_round_trip(tmp_path, spy):
    stock, ours = _pair(dtype=torch.float32)
    pixels, _ = _inputs(torch.float32)
    ours.save_pretrained(tmp_path / "swapped")
    loaded = CLIPVisionModel.from_pretrained(tmp_path / "swapped").eval()
    assert not swapped_layers(loaded)                     # a plain CLIP checkpoint
    for (name, a), b in zip(ours.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    stock.save_pretrained(tmp_path / "stock")
    reloaded = swap_attention(CLIPVisionModel.from_pretrained(tmp_path / "stock").eval())
    with torch.no_grad():
        want = stock(pixel_values=pixels).last_hidden_state
        got_loaded = loaded(pixel_values=pixels).last_hidden_state
        got_reloaded = reloaded(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(got_loaded, want, rtol=0, atol=0)
    assert ((got_reloaded - want).norm() / want.norm()).item() < 2e-5
    assert len(spy) == 2


@pytest.mark.parametrize("first_call_before_swap", [False, True])
def test_output_hidden_states(first_call_before_swap, spy):
    """transformers 5 installs its capture hooks at the first forward that asks for
    hidden states: the swapped layers work whether that was before or after the swap."""
    stock = _clip()
    pixels, _ = _inputs()
    want = stock(pixel_values=pixels, output_hidden_states=True).hidden_states
    ours = stock if first_call_before_swap else copy.deepcopy(stock)
    swap_attention(ours)
    got = ours(pixel_values=pixels, output_hidden_states=True).hidden_states
    assert len(spy) == 2
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not torch.equal(got[1], got[2])          # the layers' own outputs, not copies


def _first_layer(model):
    return next((name, m) for name, m in model.named_modules()
                if type(m).__name__ == "CLIPEncoderLayer")


@pytest.mark.parametrize("where, register, kind", [
    ("self_attn", lambda m: m.register_forward_hook(lambda *args: None), "forward"),
    ("layer_norm1", lambda m: m.register_forward_pre_hook(lambda *args: None),
     "forward-pre"),
    ("self_attn.v_proj", lambda m: m.register_full_backward_hook(lambda *args: None),
     "backward"),
])
def test_hooks_on_bypassed_submodules_are_refused_at_the_swap(where, register, kind):
    """A user's hook on a submodule whose forward the fused block does not call would
    silently stop firing: refused at the swap, naming it, and nothing is swapped.
    transformers' own output-capture hooks (on self_attn after a call that asked for
    hidden states, test_output_hidden_states) are let through; hooks on the layer itself fire."""
    model = _clip()
    name, layer = _first_layer(model)
    handle = register(layer.get_submodule(where))
    _refused(model, rf"{name}: {where} has {kind} hooks \(.*"
                    r"test_hf\..*<lambda>\), which would no longer "
                    "fire")
    handle.remove()
    seen = []
    layer.register_forward_hook(lambda module, args, output: seen.append(module))
    swap_attention(model)(pixel_values=_inputs()[0])
    assert seen == [layer] and len(swapped_layers(model)) == 2


def test_output_attentions_is_refused_clearly():
    stock, ours = _pair()
    pixels, _ = _inputs()
    # (transformers 5 refuses output_attentions in the config of an sdpa model)
    stock.config._attn_implementation = ours.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        ours(pixel_values=pixels, output_attentions=True)
    ours.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        ours(pixel_values=pixels)
    ours.config.output_attentions = False
    # unswap_attention gives the maps back, from the same weights
    unswap_attention(ours)
    assert not swapped_layers(ours)
    got = ours(pixel_values=pixels, output_attentions=True).attentions
    want = stock(pixel_values=pixels, output_attentions=True).attentions
    assert len(got) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_adamw_steps_track_the_stock_model():
    stock, ours = _pair()
    losses = {key: adamw_losses(model, _loss, lambda step: _inputs(seed=10 + step), 5,
                                lr=1e-2)
              for key, model in (("stock", stock), ("ours", ours))}
    torch.testing.assert_close(torch.tensor(losses["ours"]), torch.tensor(losses["stock"]),
                               rtol=1e-10, atol=0)
    assert losses["ours"][-1] != losses["ours"][0]
    for (name, a), (_, b) in zip(ours.named_parameters(), stock.named_parameters()):
        if name.endswith("k_proj.bias"):
            # no gradient in exact math: AdamW turns both models' rounding noise into
            # +-lr steps of random sign, and the outputs do not depend on it
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


def test_siglip_tower_carries_its_layer_norm_eps(spy):
    """SigLIP's layers use their config's eps (1e-6 in released models); a large one
    here makes a wrong eps visible (it changes the outputs by ~1e-2)."""
    kwargs = dict(config_cls=SiglipVisionConfig, model_cls=SiglipVisionModel,
                  layer_norm_eps=0.1)
    stock, ours = _pair(**kwargs)
    assert stock.config.layer_norm_eps == 0.1
    pixels, weight = _inputs(batch=2)
    want = stock(pixel_values=pixels).last_hidden_state
    got = ours(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(spy) == 2
    _, grads_want = _grads(stock, pixels, weight[:, :4])     # SigLIP: 4 tokens, no CLS
    _, grads_got = _grads(ours, pixels, weight[:, :4])
    for name, err in _errors(grads_got, grads_want).items():
        assert err < 1e-10, (name, err)
    # the default SigLIP eps, 1e-6, is carried into the fused layers as well
    default = swap_attention(SiglipVisionModel(SiglipVisionConfig(**TINY)))
    assert default.config.layer_norm_eps == 1e-6
    layers = [m for n, m in default.named_modules() if n in swapped_layers(default)]
    assert len(layers) == 2 and all(m.layer_norm1.eps == 1e-6 for m in layers)


def test_clip_model_swaps_only_its_vision_tower(spy):
    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(hidden_size=32, intermediate_size=64,
                                         num_attention_heads=2, num_hidden_layers=2,
                                         vocab_size=50, max_position_embeddings=8),
                        vision_config=TINY, projection_dim=16)
    stock = _perturb(CLIPModel(config).eval())     # float32: 4.x text masks overflow in float64
    ours = swap_attention(copy.deepcopy(stock))
    names = swapped_layers(ours)
    assert len(names) == 2 and all("vision" in n for n in names), names
    ids = torch.randint(0, 50, (2, 6))
    pixels, _ = _inputs(torch.float32, batch=2)
    want = stock(input_ids=ids, pixel_values=pixels)
    got = ours(input_ids=ids, pixel_values=pixels)
    assert len(spy) == 2
    err = ((got.logits_per_image - want.logits_per_image).norm()
           / want.logits_per_image.norm()).item()
    assert err < 2e-5, err
    torch.testing.assert_close(got.text_embeds, want.text_embeds, rtol=0, atol=0)


def test_autocast_bfloat16_training_step():
    """Under autocast the swapped attention halves follow autocast as the stock ones do
    (vitattn_bwd.module, precision None): forward and backward complete, gradients come
    back in float32 (the parameters' dtype), and the result stays within bf16 accuracy
    of the float64 model."""
    stock64 = _clip()
    ours = swap_attention(copy.deepcopy(stock64).float())
    pixels, weight = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(pixel_values=pixels).last_hidden_state
        loss = _loss(ours, pixels, weight)
    loss.backward()
    want = stock64(pixel_values=pixels.double()).last_hidden_state
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < 2e-2, err
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


def test_gradient_checkpointing(spy):
    stock, ours = _pair()
    for model in (stock, ours):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(
            use_reentrant=False))
    pixels, weight = _inputs()
    _, want = _grads(stock, pixels, weight)
    _, got = _grads(ours, pixels, weight)
    assert len(spy) >= 2
    for name, err in _errors(got, want).items():
        assert err < 1e-12, (name, err)


def test_unsupported_layers_are_refused_at_the_swap():
    with pytest.raises(ValueError, match="attention dropout 0.1 > 0 is not supported"):
        swap_attention(_clip(attention_dropout=0.1))
    with pytest.raises(ValueError, match="found no encoder layer"):
        swap_attention(nn.Sequential(nn.Linear(4, 4)))
    # a forward set on the instance (accelerate's hooks) would bypass the swap
    model = _clip()
    layer = model.get_submodule([n for n, m in model.named_modules()
                                 if type(m).__name__ == "CLIPEncoderLayer"][0])
    layer.forward = layer.forward
    with pytest.raises(ValueError, match="overridden on the instance"):
        swap_attention(model)
    assert not swapped_layers(model)                  # nothing swapped half-way
    # a bare encoder is not inside a *Vision* module: only with vision_only=False
    encoder = _clip().encoder if hasattr(_clip(), "encoder") else _clip().vision_model.encoder
    with pytest.raises(ValueError, match="vision_only=False"):
        swap_attention(encoder)
    assert len(swapped_layers(swap_attention(encoder, vision_only=False))) == 2


class MessageTokenLayer(transformers.models.clip.modeling_clip.CLIPEncoderLayer):
    """A CLIP layer whose forward adds to the stock math (as X-CLIP's vision layers add a
    cross-frame message token): the swap must not take it for a CLIP layer."""

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = hidden_states + 1.0
        return super().forward(hidden_states, *args, **kwargs)


class CopiedClipLayer(transformers.models.clip.modeling_clip.CLIPEncoderLayer):
    """A layer whose forward is CLIP's math in code of its own (renamed variables)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        skip = hidden_states
        hidden_states = skip + self.self_attn(self.layer_norm1(hidden_states),
                                              attention_mask=attention_mask, **kwargs)[0]
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


def _with_layer_class(model, cls):
    for module in model.modules():
        if type(module).__name__ == "CLIPEncoderLayer":
            module.__class__ = cls
    return model


def test_layers_that_compute_more_than_clips_forward_are_refused_at_the_swap():
    """A layer class is swapped where its forward's code is CLIPEncoderLayer.forward's
    (transformers copies it into SigLIP, Idefics2, OwlViT, ...) or it is registered;
    one whose forward adds anything (X-CLIP's message token, MLCD's rotary embeddings)
    was swapped and silently computed without it: now refused, naming the class."""
    with pytest.raises(ValueError, match=r"MessageTokenLayer.forward is not "
                                         r"CLIPEncoderLayer's"):
        swap_attention(_with_layer_class(_clip(), MessageTokenLayer))
    model = _with_layer_class(_clip(), CopiedClipLayer)
    _refused(model, "CopiedClipLayer.forward is not")
    try:
        hf.register_classes(layer=CopiedClipLayer)
        stock = _with_layer_class(_clip(), CopiedClipLayer)
        ours = swap_attention(copy.deepcopy(stock))
        assert len(swapped_layers(ours)) == 2
        pixels, weight = _inputs()
        torch.testing.assert_close(_loss(ours, pixels, weight), _loss(stock, pixels, weight),
                                   rtol=1e-12, atol=1e-12)
    finally:
        hf._REGISTERED_LAYERS.remove(CopiedClipLayer)
    if hasattr(transformers, "XCLIPVisionModel"):
        xclip = transformers.XCLIPVisionModel(transformers.XCLIPVisionConfig(**TINY))
        with pytest.raises(ValueError, match="XCLIPVisionEncoderLayer.forward is not"):
            swap_attention(xclip)


def test_attention_submodules_besides_the_projections_are_refused_at_the_swap():
    """A query / key norm (or any module) in self_attn runs inside its forward, which
    the fused block does not call."""
    model = _clip()
    layer = next(m for m in model.modules() if type(m).__name__ == "CLIPEncoderLayer")
    layer.self_attn.q_norm = nn.LayerNorm(16)
    with pytest.raises(ValueError, match=r"self_attn has submodules the fused block would "
                                         r"not run: \['q_norm'\]"):
        swap_attention(model)


def test_layer_arguments_the_block_does_not_compute_are_refused_at_the_call():
    """Rotary position embeddings or packed sequences' boundaries given to a swapped
    layer (as MiniMax-M3-VL's and VideoLlama3's encoders pass them) would be left out:
    refused by name, as are extra positional arguments; None and the output flags pass."""
    _, ours = _pair()
    layer = ours.get_submodule(swapped_layers(ours)[0])
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    rope = (torch.ones(5, 16, dtype=torch.float64),) * 2
    with pytest.raises(ValueError, match=r"does not support \['cu_seqlens', "
                                         r"'position_embeddings'\]"):
        layer(x, position_embeddings=rope, cu_seqlens=torch.tensor([0, 5]))
    if not layer._vitattn_legacy:
        with pytest.raises(ValueError, match="takes hidden_states and an attention mask"):
            layer(x, None, rope)
    out = layer(x, position_embeddings=None, output_hidden_states=True)
    assert (out[0] if layer._vitattn_legacy else out).shape == x.shape


_LOAD_IN_A_FRESH_PROCESS = """
import sys, torch
from vitattn_bwd.integrations import _common
model = torch.load(sys.argv[1], weights_only=False)
pixels = torch.load(sys.argv[2])
layers = [m for m in model.modules() if _common.is_swapped(m)]
assert [m._vitattn_precision for m in layers] == ["highest", "highest"], layers
torch.save(model(pixel_values=pixels).last_hidden_state, sys.argv[3])
"""


def test_a_swapped_model_saved_whole_loads_in_a_fresh_process(tmp_path):
    """torch.save of a whole swapped model, torch.load in a process that has not swapped
    (whose integration modules have no fused class yet): its layers come back swapped,
    with their precision, and compute what they computed; copy.deepcopy the same."""
    _, ours = _pair()
    ours = swap_attention(unswap_attention(ours), precision="highest")
    pixels, _ = _inputs()
    want = ours(pixel_values=pixels).last_hidden_state
    torch.save(ours, tmp_path / "model.pt")
    torch.save(pixels, tmp_path / "pixels.pt")
    subprocess.run([sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, tmp_path / "model.pt",
                    tmp_path / "pixels.pt", tmp_path / "out.pt"], check=True,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), want, rtol=0, atol=0)
    copied = copy.deepcopy(ours)
    assert len(swapped_layers(copied)) == 2
    torch.testing.assert_close(copied(pixel_values=pixels).last_hidden_state, want,
                               rtol=0, atol=0)


def test_attention_settings_changed_after_the_swap_are_refused_at_the_call():
    """A scale or (in training) an attention dropout set on a swapped layer's self_attn
    after the swap: refused at the next call, naming the layer, rather than ignored; a
    dropout in eval mode applies to neither model, and the swap computes the stock
    output."""
    stock, ours = _pair()
    pixels, _ = _inputs()
    for model in (stock, ours):
        for layer in model.modules():
            if type(layer).__name__.endswith("CLIPEncoderLayer"):
                layer.self_attn.dropout = 0.5
    torch.testing.assert_close(ours(pixel_values=pixels).last_hidden_state,
                               stock(pixel_values=pixels).last_hidden_state)
    with pytest.raises(ValueError, match=r"encoder\.layers\.0.*attention dropout 0\.5"):
        ours.train()(pixel_values=pixels)
    ours.eval()
    ours.get_submodule([n for n, m in ours.named_modules()
                        if type(m).__name__.endswith("CLIPEncoderLayer")][1]).self_attn.scale = 1.0
    with pytest.raises(ValueError, match=r"encoder\.layers\.1.*attention scale 1\.0"):
        ours(pixel_values=pixels)


def _encoder_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("CLIPEncoderLayer")]


class _LoraLinear(nn.Linear):
    """An nn.Linear whose forward adds a term (loralib's adapters are such subclasses)."""

    def forward(self, x):
        return super().forward(x) + 1.0


class _BareWrapper(nn.Module):
    """A module holding a Linear and adding to its output, with no Linear attribute of
    its own (as peft's LoRA layer holds its base layer)."""

    def __init__(self, linear):
        super().__init__()
        self.base = linear

    def forward(self, x):
        return 2 * self.base(x)


class _AdapterWrapper(_BareWrapper):
    """A wrapper that exposes its Linear's weight and bias and adds to its output (as a
    PEFT-style wrapper does)."""

    def __init__(self, linear):
        super().__init__(linear)
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features


def test_projections_with_forwards_of_their_own_are_refused():
    """The fused block reads the q / k / v / out projections' weights and biases and
    never calls their forwards: a projection whose forward is not nn.Linear's (an
    adapter) is refused at the swap, naming it, and so is one put in its place after
    the swap, at the next call, rather than silently left out. A wrapper that is no
    nn.Linear and has none of its attributes (peft's LoRA layers wrap their Linear) is
    refused at the swap too, naming it, in a CLIP layer and in a Molmo-style one; the
    other layers stay stock."""
    stock = _clip()
    _encoder_layers(stock)[1].self_attn.v_proj.__class__ = _LoraLinear
    _refused(stock, r"encoder\.layers\.1: self_attn\.v_proj is "
                    r"tests.test_hf._LoraLinear, whose forward is not "
                    r"torch.nn.modules.linear.Linear's")
    stock = _clip()
    attn = _encoder_layers(stock)[1].self_attn
    attn.q_proj = _BareWrapper(attn.q_proj)
    _refused(stock, r"encoder\.layers\.1: self_attn\.q_proj is "
                    r"tests.test_hf._BareWrapper, whose forward is "
                    r"not torch.nn.modules.linear.Linear's")
    molmo = VisionTransformer()
    molmo.resblocks[0].attention.wv = _BareWrapper(molmo.resblocks[0].attention.wv)
    _refused(molmo, r"resblocks\.0: attention\.wv is "
                    r"tests.test_hf._BareWrapper", vision_only=False)
    _, ours = _pair()
    pixels, _ = _inputs()
    attn = _encoder_layers(ours)[0].self_attn
    attn.k_proj = _AdapterWrapper(attn.k_proj)
    with pytest.raises(ValueError, match=r"encoder\.layers\.0 \(VitAttnCLIPEncoderLayer, "
                                         r"vitattn_bwd fused attention\): self_attn\.k_proj "
                                         r"is tests.test_hf._AdapterWrapper"):
        ours(pixel_values=pixels)


def test_attention_modules_with_forwards_of_their_own_are_refused():
    """The fused layer reads self_attn's projections and never calls its forward: a
    subclass of CLIPAttention with a forward of its own (attention editing, an extra
    term) is refused at the swap, naming its class, rather than silently dropped."""
    from transformers.models.clip.modeling_clip import CLIPAttention

    class EditedAttention(CLIPAttention):
        def forward(self, hidden_states, *args, **kwargs):
            output, weights = super().forward(hidden_states, *args, **kwargs)
            return 0.5 * output, weights

    stock = _clip()
    _encoder_layers(stock)[1].self_attn.__class__ = EditedAttention
    _refused(stock, r"encoder\.layers\.1: self_attn is tests\.test_hf\."
                    r".*EditedAttention, whose forward is not "
                    r"transformers' own")


def test_attention_mask_is_refused():
    """... naming the layer by its path in the model (the swap records it, as the timm
    and OpenCLIP swaps do: integrations._common)."""
    _, ours = _pair()
    path = swapped_layers(ours)[0]
    layer = ours.get_submodule(path)
    assert layer._vitattn_path == path
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"^{path} \(VitAttnCLIPEncoderLayer, vitattn_bwd "
                                         r"fused attention\) does not support "
                                         r"attention_mask"):
        layer(x, mask) if not layer._vitattn_legacy else layer(x, mask, None)
    unswap_attention(ours)
    assert not any(a.startswith("_vitattn_") for a in vars(layer))


# A Molmo-style vision tower (the names of Molmo's image ViT: resblocks of
# attention_norm, attention.{wq,wk,wv,wo}, ffn_norm, feed_forward).
class MolmoStyleAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, S, E = x.shape
        q, k, v = (lin(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
                   for lin in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(B, S, E))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, dim, heads, eps):
        super().__init__()
        self.attention = MolmoStyleAttention(dim, heads)
        self.feed_forward = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                          nn.Linear(2 * dim, dim))
        self.attention_norm = nn.LayerNorm(dim, eps=eps)
        self.ffn_norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class VisionTransformer(nn.Module):
    def __init__(self, dim=32, heads=4, layers=2, eps=1e-3):
        super().__init__()
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(dim, heads, eps)
                                       for _ in range(layers))

    def forward(self, x):
        for block in self.resblocks:
            x = block(x)
        return x


def test_molmo_style_tower(spy):
    torch.manual_seed(0)
    stock = _perturb(VisionTransformer().double())
    ours = swap_attention(copy.deepcopy(stock))
    assert swapped_layers(ours) == ["resblocks.0", "resblocks.1"]
    assert list(ours.state_dict()) == list(stock.state_dict())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    g = torch.randn(2, 7, 32, dtype=torch.float64)
    want, got = stock(x), ours(x)
    assert len(spy) == 2
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, list(ours.parameters()), g),
                    torch.autograd.grad(want, list(stock.parameters()), g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# Molmo's names in blocks that compute something else: a Llama-style block with a
# LayerNorm and causal attention, and a post-norm block.
class CausalAttention(MolmoStyleAttention):
    def forward(self, x):
        B, S, E = x.shape
        q, k, v = (lin(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
                   for lin in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, S, E))


class CausalBlock(ResidualAttentionBlock):
    def __init__(self, dim, heads, eps):
        super().__init__(dim, heads, eps)
        self.attention = CausalAttention(dim, heads)


class PostNormBlock(ResidualAttentionBlock):
    def forward(self, x):
        x = self.attention_norm(x + self.attention(x))
        return self.ffn_norm(x + self.feed_forward(x))


def _tower_of(block_class, layers=2, dim=32, heads=4):
    tower = VisionTransformer(dim, heads, layers)
    tower.resblocks = nn.ModuleList(block_class(dim, heads, 1e-3) for _ in range(layers))
    return tower


@pytest.mark.parametrize("block_class", [CausalBlock, PostNormBlock])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_molmo_named_layers_computing_otherwise_are_refused(block_class, device):
    """The swap runs a CPU copy of a Molmo-style layer on random tokens (random
    parameters on the meta device) and refuses, naming it, a layer whose math is not
    the swapped layer's; nothing is swapped. Molmo's own math passes the same probe,
    on the meta device too."""
    with torch.device(device):
        refused, plain = _tower_of(block_class), _tower_of(ResidualAttentionBlock)
    _refused(refused, r"resblocks\.0: \w+Block does not compute x \+ "
                      r"attention\(attention_norm\(x\)\).*differs", vision_only=False)
    assert swapped_layers(swap_attention(plain, vision_only=False)) == \
        ["resblocks.0", "resblocks.1"]


def test_registered_molmo_style_layer_is_not_probed(monkeypatch):
    class RegisteredBlock(ResidualAttentionBlock):
        pass
    monkeypatch.setattr(hf, "_REGISTERED_LAYERS", [])
    hf.register_classes(layer=RegisteredBlock)
    probed = []
    monkeypatch.setattr(hf, "_check_molmo_math", lambda *a: probed.append(a))
    tower = swap_attention(_tower_of(RegisteredBlock), vision_only=False)
    assert swapped_layers(tower) == ["resblocks.0", "resblocks.1"] and not probed
    swap_attention(_tower_of(ResidualAttentionBlock), vision_only=False)
    assert len(probed) == 2


class EinsumAttention(MolmoStyleAttention):
    """Molmo's other attention form: scores by einsum from q / sqrt(d) and k in float32,
    softmax in float32, then the values."""
    def forward(self, x):
        B, S, E = x.shape
        q, k, v = (lin(x).view(B, S, self.num_heads, self.head_dim)
                   for lin in (self.wq, self.wk, self.wv))
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float() / self.head_dim ** 0.5, k.float())
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, S, E)
        return self.wo(out)


class EinsumBlock(ResidualAttentionBlock):
    def __init__(self, dim, heads, eps):
        super().__init__(dim, heads, eps)
        self.attention = EinsumAttention(dim, heads)


def test_molmo_probe_leaves_the_model_and_process_as_they_were():
    """The check runs on a copy with random parameters: the layer's own weights (here a
    causal block whose output projection is zero, as at a zero init, which would hide
    the mask) do not decide it, the global RNG and the training flags are untouched,
    and a default device or dtype set by the caller does not reach the probe's
    tensors. Molmo's einsum form of the attention passes."""
    causal = _tower_of(CausalBlock)
    for block in causal.resblocks:
        torch.nn.init.zeros_(block.attention.wo.weight)
    with pytest.raises(ValueError, match="does not compute"):
        swap_attention(causal, vision_only=False)
    tower = _tower_of(EinsumBlock).train()
    before = {n: p.clone() for n, p in tower.named_parameters()}
    state = torch.get_rng_state()
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with torch.device("meta"):
            swap_attention(tower, vision_only=False)
    finally:
        torch.set_default_dtype(default_dtype)
    assert swapped_layers(tower) == ["resblocks.0", "resblocks.1"]
    assert torch.equal(torch.get_rng_state(), state)
    assert all(m.training for m in tower.modules())
    assert all(torch.equal(p, before[n]) for n, p in tower.named_parameters())


class ExtraArgumentBlock(ResidualAttentionBlock):
    def forward(self, x, position_ids):
        return super().forward(x) + position_ids


class TupleBlock(ResidualAttentionBlock):
    def forward(self, x):
        return (super().forward(x),)


class LayerDropoutBlock(ResidualAttentionBlock):
    def __init__(self, dim, heads, eps):
        super().__init__(dim, heads, eps)
        self.drop_path = nn.Dropout(0.1)


class UncopyableBlock(ResidualAttentionBlock):
    def __deepcopy__(self, memo):        # as FSDP2's fully_shard makes a module's class
        raise AssertionError("FSDP does not support deepcopy.")


@pytest.mark.parametrize("block_class, message", [
    (ExtraArgumentBlock, "a CPU copy of ExtraArgumentBlock failed on random tokens"),
    (TupleBlock, r"TupleBlock\.forward returns <class 'tuple'>"),
    (LayerDropoutBlock, r"submodules the fused layer would not run: \['drop_path'\]"),
    (UncopyableBlock, "could not be copied.*FSDP2's fully_shard"),
])
def test_molmo_style_layers_that_cannot_be_checked_are_refused(block_class, message):
    tower = _tower_of(block_class)
    _refused(tower, r"resblocks\.0: .*" + message + ".*register_classes", vision_only=False)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_molmo_style_attention_dropout_modules(p):
    """Dropouts among the attention module's children (Molmo's attention_dropout and
    residual_dropout are nn.Dropout subclasses): p = 0 is swapped, p > 0 refused at the
    swap, as CLIP's attention dropout is."""
    tower = _tower_of(ResidualAttentionBlock)
    for block in tower.resblocks:
        block.attention.residual_dropout = nn.Dropout(p)
    if p:
        _refused(tower, r"resblocks\.0: attention dropout 0\.1 > 0", vision_only=False)
    else:
        assert len(swapped_layers(swap_attention(tower, vision_only=False))) == 2


# Molmo's DinoResidualAttentionBlock (olmo/image_vit.py): per-channel layer scales
# lambda1 / lambda2 (ones at init, trained), each multiplying its half's output.
class DinoResidualAttentionBlock(ResidualAttentionBlock):
    def __init__(self, dim, heads, eps):
        super().__init__(dim, heads, eps)
        self.lambda1 = nn.Parameter(torch.ones(dim))
        self.lambda2 = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x)) * self.lambda1
        return x + self.feed_forward(self.ffn_norm(x)) * self.lambda2


class Lambda1InsideBlock(DinoResidualAttentionBlock):
    """lambda1 on the attention's values before the out projection: not a layer scale."""
    def forward(self, x):
        h = self.attention_norm(x)
        B, S, E = h.shape
        attn = self.attention
        q, k, v = (lin(h).view(B, S, attn.num_heads, attn.head_dim).transpose(1, 2)
                   for lin in (attn.wq, attn.wk, attn.wv))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, E)
        x = x + attn.wo(o * self.lambda1)
        return x + self.feed_forward(self.ffn_norm(x)) * self.lambda2


def test_molmo_dino_block_with_layer_scales_swaps_exactly(spy):
    """lambda1 folded into the fused half's out projection, lambda2 on the stock FFN
    half: in float64 the output and every parameter's gradient (lambda1 and lambda2
    among them, moved off their init of ones) equal the stock tower's."""
    torch.manual_seed(0)
    stock = _perturb(_tower_of(DinoResidualAttentionBlock).double())
    ours = swap_attention(copy.deepcopy(stock), vision_only=False)
    assert swapped_layers(ours) == ["resblocks.0", "resblocks.1"]
    assert list(ours.state_dict()) == list(stock.state_dict())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    g = torch.randn(2, 7, 32, dtype=torch.float64)
    want, got = stock(x), ours(x)
    assert len(spy) == 2                              # both layers ran the fused half
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    names = [n for n, _ in ours.named_parameters()]
    assert "resblocks.0.lambda1" in names and "resblocks.1.lambda2" in names
    for name, a, b in zip(names, torch.autograd.grad(got, list(ours.parameters()), g),
                          torch.autograd.grad(want, list(stock.parameters()), g)):
        assert a.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_molmo_style_layer_scales_used_otherwise_or_misshapen_are_refused():
    """A lambda1 that is not a scale of the half's output fails the probe; a layer
    scale that is not a [E] tensor is refused by name."""
    _refused(_tower_of(Lambda1InsideBlock), r"resblocks\.0: Lambda1InsideBlock does not "
             r"compute x \+ attention\(attention_norm\(x\)\) \[\* lambda1\].*differs",
             vision_only=False)
    tower = _tower_of(DinoResidualAttentionBlock)
    tower.resblocks[0].lambda2 = nn.Parameter(torch.ones(1, 32))
    _refused(tower, r"resblocks\.0: lambda2 must be a floating tensor of shape \(32,\)",
             vision_only=False)


# --------------------------------------------------------------------------------------
# inside torch.compile
# --------------------------------------------------------------------------------------
def _compiled_grads(model, pixels, weight):
    """_grads through torch.compile(model, fullgraph=True), read from model's own
    parameters."""
    compiled = torch.compile(model, fullgraph=True)
    model.zero_grad(set_to_none=True)
    loss = _loss(compiled, pixels, weight)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_swapped_float32_tower_compiles_in_one_graph(spy):
    """float32: no graph break (the output-attentions probe reads no context variable
    while dynamo traces; the routing reads torch's precision once per trace), the fused
    block's forward as our operator in the user's graph, and torch.compile
    (fullgraph=True)'s forward and backward equal to the eager swap's within float32
    rounding and as close to the float64 stock tower."""
    stock64 = _clip()
    ours = swap_attention(copy.deepcopy(stock64).float())
    pixels, weight = _inputs(torch.float32)
    assert graph_breaks_and_ops(ours, pixel_values=pixels) == (0, {"vitattn_bwd.vision_attention_fwd"})
    assert len(spy) == 2                     # the swapped halves ran, inside the trace
    got, got_grads = _compiled_grads(ours, pixels, weight)
    eager, eager_grads = _grads(ours, pixels, weight)
    want, want_grads = _grads(stock64, pixels.double(), weight.double())
    assert abs(got - eager) < 1e-6 * abs(eager)
    assert abs(got.double() - want) < 2e-5 * abs(want)
    for name, err in _errors(got_grads, eager_grads).items():
        assert err < 1e-5, (name, err)
    for name, err in _errors(got_grads, want_grads).items():
        assert err < 2e-5, (name, err)


def test_swapped_tower_compiles_with_dynamic_shapes_in_one_graph():
    """torch.compile(dynamic=True, fullgraph=True): the layers' eps, attention scale and
    dropout are then symbolic floats, which the swapped forward's checks compare rather
    than pass to math functions; each batch size gives the stock tower's output."""
    stock, ours = _pair(dtype=torch.float32)
    compiled = torch.compile(ours, dynamic=True, fullgraph=True)
    for batch in (2, 3):
        pixels, _ = _inputs(torch.float32, batch=batch)
        torch.testing.assert_close(compiled(pixel_values=pixels).last_hidden_state,
                                   stock(pixel_values=pixels).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)


def test_swapped_tower_under_autocast_compiles_the_stock_ops_in_one_graph():
    """Under bf16 autocast (precision None) the swapped attention halves are the stock
    ops (vitattn_bwd.routing): no graph break, none of our operators, the compiled step
    within bf16 rounding of the eager one."""
    stock64 = _clip()
    ours = swap_attention(copy.deepcopy(stock64).float())
    pixels, weight = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert graph_breaks_and_ops(ours, pixel_values=pixels) == (0, set())
        got, got_grads = _compiled_grads(ours, pixels, weight)
        eager, eager_grads = _grads(ours, pixels, weight)
    # (measured: 2.6e-3 for the loss and up to 1.4e-2 for a gradient, the same as the
    # stock tower's compiled step against its eager one: Inductor rounds to bf16 at
    # other places than eager autocast does)
    assert abs(got - eager) < 1e-2 * abs(eager)
    for name, err in _errors(got_grads, eager_grads).items():
        assert err < 4e-2, (name, err)
    assert all(g.dtype == torch.float32 for g in got_grads.values())


def test_output_attentions_and_hidden_states_under_compile():
    """Inside torch.compile the refusal of output_attentions still holds (from the
    call's kwargs and from the config), and output_hidden_states still works."""
    stock, ours = _pair(dtype=torch.float32)
    pixels, _ = _inputs(torch.float32)
    stock.config._attn_implementation = ours.config._attn_implementation = "eager"
    compiled = torch.compile(ours)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        compiled(pixel_values=pixels, output_attentions=True)
    got = compiled(pixel_values=pixels, output_hidden_states=True).hidden_states
    want = stock(pixel_values=pixels, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    ours.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        torch.compile(ours)(pixel_values=pixels)
