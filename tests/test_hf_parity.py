"""Parity with an independent implementation: Hugging Face `transformers`.

Our GPT-2 style and Llama style models (GQA, MQA, tied and untied heads, with and without
biases) are mapped onto `GPT2LMHeadModel` / `LlamaForCausalLM` built from config (no
download, eager attention), and back; the logits must agree to 1e-4 in fp32. Each test
prints the largest difference it measured (`pytest -s` shows them).
"""

from __future__ import annotations

import pytest
import torch

from frawdllm import FrawdError, get_config
from frawdllm.export.hf import (
    from_hf_config, from_hf_model, from_hf_state_dict, to_hf_config, to_hf_state_dict,
)
from interop_helpers import SMALL, VARIANTS, random_ids, randomize_, small_model

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def hf_from_config(hf_config):
    return transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_computes_our_logits_after_mapping_ours_to_hf(variant):
    model = small_model(variant)
    cfg = model.config
    hf_model = hf_from_config(to_hf_config(cfg))
    result = hf_model.load_state_dict(to_hf_state_dict(model.state_dict(), cfg), strict=False)
    assert result.unexpected_keys == []
    assert set(result.missing_keys) == ({"lm_head.weight"} if cfg.tie_embeddings else set())
    ids = random_ids(cfg.vocab_size)  # the full context: every position is checked
    with torch.no_grad():
        ours, _ = model(ids)
        theirs = hf_model(ids).logits
    diff = max_diff(ours, theirs)
    print(f"parity ours->hf {variant}: max_abs_diff={diff:.3e} (logits up to {ours.abs().max():.2f})")
    assert diff < TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_we_compute_transformers_logits_after_mapping_hf_to_ours(variant):
    cfg = small_model(variant).config
    hf_model = randomize_(hf_from_config(to_hf_config(cfg)), seed=7)
    model = from_hf_model(hf_model)
    assert model.config == from_hf_config(hf_model.config)
    ids = random_ids(cfg.vocab_size, seed=3)
    with torch.no_grad():
        theirs = hf_model(ids).logits
        ours, _ = model(ids)
    diff = max_diff(ours, theirs)
    print(f"parity hf->ours {variant}: max_abs_diff={diff:.3e}")
    assert diff < TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mapping_there_and_back_is_bitwise(variant):
    model = small_model(variant)
    cfg = model.config
    back = from_hf_state_dict(to_hf_state_dict(model.state_dict(), cfg), cfg)
    for key, tensor in model.state_dict().items():
        assert torch.equal(back[key], tensor), key


def test_integer_tensors_are_not_imported_as_weights():
    """A float32 bias relabelled I32 in its safetensors header was imported exit 0, its bits
    read as integers and cast: values like 9.4e8 where 3e-5 was."""
    from frawdllm.errors import FrawdError

    model = small_model("gpt2-tied")
    hf_state = to_hf_state_dict(model.state_dict(), model.config)
    name = next(n for n in sorted(hf_state) if n.endswith("attn.c_attn.bias"))
    hf_state[name] = hf_state[name].view(torch.int32)
    with pytest.raises(FrawdError, match=f"checkpoint tensor .*{name.split('.', 1)[-1]} holds int32, not "
                                         "floating-point weights"):
        from_hf_state_dict(hf_state, model.config)


def test_bias_free_gpt2_exports_zero_biases_and_imports_as_biased():
    model = small_model("gpt2-nobias")
    hf_state = to_hf_state_dict(model.state_dict(), model.config)
    assert torch.count_nonzero(hf_state["transformer.h.0.attn.c_attn.bias"]) == 0
    assert torch.count_nonzero(hf_state["transformer.ln_f.bias"]) == 0
    assert from_hf_config(to_hf_config(model.config)) == model.config.replace(bias=True)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "gpt2-nobias"])
def test_config_survives_the_trip_through_transformers(variant):
    cfg = small_model(variant).config.replace(norm_eps=1e-6)
    if cfg.pos_encoding == "rope":  # GPT-2 has no RoPE, so rope_theta does not travel
        cfg = cfg.replace(rope_theta=5000.0)
    assert from_hf_config(to_hf_config(cfg)) == cfg


@pytest.mark.parametrize(
    "overrides, option, fix",
    [
        ({"pos_encoding": "sinusoidal"}, "pos_encoding='sinusoidal'", "--set pos_encoding=learned"),
        ({"pos_encoding": "none"}, "pos_encoding='none'", "--set pos_encoding=learned"),
        ({"norm_placement": "post"}, "norm_placement='post'", "--set norm_placement=pre"),
        ({"scale_embeddings": True}, "scale_embeddings=True", "--set scale_embeddings=false"),
        ({"pos_encoding": "rope"}, "pos_encoding='rope'", "--set pos_encoding=learned"),
        ({"use_rmsnorm": True}, "use_rmsnorm=True", "--set use_rmsnorm=false"),
        ({"n_kv_head": 2}, "n_kv_head=2", "--set n_kv_head=4"),
    ],
)
def test_unexportable_variant_error_names_the_option_and_the_nearest_config(overrides, option, fix):
    cfg = get_config("tiny", **SMALL, **overrides)
    with pytest.raises(FrawdError) as info:
        to_hf_config(cfg)
    message = str(info.value)
    assert option in message and fix in message and "\n" not in message


def test_llama_style_with_layernorm_suggests_the_llama_fix_first():
    cfg = get_config("tiny-llama", **SMALL, use_rmsnorm=False)
    with pytest.raises(FrawdError, match=r"exportable .*: LlamaForCausalLM \(RoPE, RMSNorm, SwiGLU MLP\) with "
                                         r"--set use_rmsnorm=true \(this model has use_rmsnorm=False\); or GPT2"):
        to_hf_config(cfg)


def test_rope_with_layernorm_names_what_llama_needs_not_only_learned_positions():
    # The 100m preset: RoPE with LayerNorm and a GELU MLP. Llama computes RoPE; its norms and MLP differ.
    with pytest.raises(FrawdError) as info:
        to_hf_config(get_config("100m"))
    message = str(info.value)
    assert "GPT2LMHeadModel (learned positions, LayerNorm, GELU MLP) with --set pos_encoding=learned" in message
    assert ("LlamaForCausalLM (RoPE, RMSNorm, SwiGLU MLP) with --set use_rmsnorm=true --set use_swiglu=true "
            "(this model has use_rmsnorm=False, use_swiglu=False)") in message


@pytest.mark.parametrize(
    "make, option",
    [
        (lambda: transformers.GPT2Config(activation_function="gelu", n_layer=1), "activation_function='gelu'"),
        (lambda: transformers.LlamaConfig(num_hidden_layers=1, hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda: transformers.LlamaConfig(
            num_hidden_layers=1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
         "rope_type='linear'"),
        (lambda: transformers.BertConfig(), "model_type='bert'"),
    ],
)
def test_transformers_features_we_cannot_compute_are_refused_by_name(make, option):
    with pytest.raises(FrawdError, match=option):
        from_hf_config(make())
