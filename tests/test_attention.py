"""Attention in its three uses: every kernel equals the reference attention, and the
decoder-only model computes bit for bit what it did before attention was generalised."""

import pytest
import torch

import frozen_decoder
from frawdllm import FrawdLLM, ModelConfig
from frawdllm.infer.cache import KVCache
from frawdllm.model import cpu_attention, kernels
from frawdllm.model.attention import CrossAttention, SelfAttention, reference_attention

CONFIGS = {
    "gpt2": dict(),
    "llama_gqa": dict(pos_encoding="rope", use_rmsnorm=True, use_swiglu=True, bias=False, n_kv_head=2),
    "post_ln_sinusoidal": dict(pos_encoding="sinusoidal", norm_placement="post", scale_embeddings=True,
                               tie_embeddings=False),
    "mqa_dropout": dict(n_kv_head=1, dropout=0.1),
}


def small_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=96, n_embd=64, n_layer=2, n_head=4, context_length=48), **kw})


def _with_frozen_attention(model: FrawdLLM) -> FrawdLLM:
    """The same model (same weights) with the pre-generalisation blocks and attention."""
    frozen = FrawdLLM(model.config)
    frozen.blocks = torch.nn.ModuleList(frozen_decoder.TransformerBlock(model.config, i)
                                        for i in range(model.config.n_layer))
    frozen.load_state_dict(model.state_dict())
    return frozen.train(model.training)


def _run(model: FrawdLLM, ids: torch.Tensor, dtype: torch.dtype):
    """Logits, loss and gradients of a training step, and a cached prefill + decode step."""
    torch.manual_seed(1)  # the same dropout masks on both sides
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits, loss = model(ids, targets=ids)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        model.eval()
        cache = KVCache(model.config, ids.shape[0], 24)
        cache.begin(20)
        prefill, _ = model(ids[:, :20], kv_cache=cache)
        cache.begin(1)
        step, _ = model(ids[:, 20:21], positions=torch.full((1, 1), 20), kv_cache=cache)
        model.train()
    return [logits, loss, *grads, prefill, step]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_only_outputs_are_bitwise_those_of_the_frozen_attention(name, dtype):
    torch.manual_seed(0)
    model = FrawdLLM(small_cfg(**CONFIGS[name])).train()
    ids = torch.randint(0, 96, (3, 40))
    ours, theirs = _run(model, ids, dtype), _run(_with_frozen_attention(model), ids, dtype)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def _qkv(B=2, H=4, Hkv=4, T=9, S=9, hd=32, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, T, hd, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, hd, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, hd, generator=g).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_causal_attend_equals_the_reference_in_inference_and_training(Hkv):
    q, k, v = _qkv(Hkv=Hkv, grad=True)
    ref = reference_attention(q, k, v, causal=True)
    with torch.no_grad():
        torch.testing.assert_close(kernels.attend(q, k, v), ref, atol=1e-5, rtol=1e-5)
    out = kernels.attend(q, k, v)  # grad enabled: the training dispatch
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), dout),
                               torch.autograd.grad(ref, (q, k, v), dout), atol=1e-5, rtol=1e-5)


def test_more_queries_than_keys_without_a_mask_is_refused():
    q, k, v = _qkv(T=5, S=3)  # (no cache gives more queries than keys: a bug upstream, named)
    with pytest.raises(ValueError, match="a KV cache must give a mask when 5 queries attend 3 keys"):
        kernels.attend(q, k, v)


def test_one_query_over_a_cache_equals_the_reference():
    q, k, v = _qkv(T=1, S=12)
    torch.testing.assert_close(kernels.attend(q, k, v), reference_attention(q, k, v, causal=True),
                               atol=1e-5, rtol=1e-5)


def test_masked_and_bidirectional_attend_equal_the_reference(monkeypatch):
    # (without dropout a mask goes to PyTorch's fused attention, not the plain-ops dropout path)
    monkeypatch.setattr(kernels, "dropout_attention", lambda *args: pytest.fail("dropout path without dropout"))
    q, k, v = _qkv(T=5, S=9, Hkv=2)
    real = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])  # (B, S): row 1 has 3 padding keys
    mask = real[:, None, None, :]
    for causal in (False, True):  # with a mask, the mask alone decides
        torch.testing.assert_close(kernels.attend(q, k, v, mask, causal=causal),
                                   reference_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.attend(q, k, v, causal=False), reference_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [3, 7, 64])  # (3: fewer tokens than blocks)
def test_blocked_causal_attention_equals_the_reference(T):
    q, k, v = _qkv(T=T, S=T)
    torch.testing.assert_close(kernels.blocked_causal_attention(q, k, v), reference_attention(q, k, v, causal=True),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_attention.available(), reason="needs a C compiler and a CPU with AVX512-BF16")
def test_cpu_bf16_kernel_equals_the_reference_within_bf16_rounding():
    q, k, v = _qkv(T=50, S=50, dtype=torch.bfloat16)
    ref = reference_attention(q.float(), k.float(), v.float(), causal=True)
    torch.testing.assert_close(cpu_attention.causal_attention(q, k, v).float(), ref, atol=2e-2, rtol=2e-2)
    # fp32 queries beside bf16 keys and values: all rounded to bf16 (the fp32 kernel read bf16 as fp32: NaN)
    torch.testing.assert_close(cpu_attention.causal_attention(q.float(), k, v).float(), ref, atol=2e-2, rtol=2e-2)


def test_padding_keys_change_nothing_in_bidirectional_self_attention():
    torch.manual_seed(0)
    attn = SelfAttention(small_cfg(), 0, causal=False).eval()
    x = torch.randn(1, 6, 64)
    padded = torch.cat([x, torch.randn(1, 4, 64)], dim=1)
    real = torch.tensor([[True] * 6 + [False] * 4])
    with torch.no_grad():
        torch.testing.assert_close(attn(padded, key_padding_mask=real)[:, :6], attn(x), atol=1e-6, rtol=1e-6)


def test_a_causal_layer_refuses_a_key_padding_mask():
    """The mask replaced causality (`attend` lets a mask alone decide): token 0 saw token 4."""
    attn = SelfAttention(small_cfg(), 0, causal=True).eval()
    with pytest.raises(ValueError, match="^key_padding_mask is for bidirectional attention; a causal layer masks "):
        attn(torch.randn(1, 6, 64), key_padding_mask=torch.ones(1, 6, dtype=torch.bool))


def test_cross_attention_ignores_padded_source_positions():
    torch.manual_seed(0)
    cross = CrossAttention(small_cfg(n_kv_head=2)).eval()
    x, memory = torch.randn(1, 3, 64), torch.randn(1, 5, 64)
    padded = torch.cat([memory, 100 * torch.randn(1, 4, 64)], dim=1)
    real = torch.tensor([[True] * 5 + [False] * 4])
    with torch.no_grad():
        torch.testing.assert_close(cross(x, cross.memory_kv(padded), real), cross(x, cross.memory_kv(memory)),
                                   atol=1e-6, rtol=1e-6)
        assert not torch.allclose(cross(x, cross.memory_kv(padded)), cross(x, cross.memory_kv(memory)))


def test_dropout_attention_equals_the_reference_without_dropout_and_drops_weights_with_it():
    from frawdllm.model.kernels import dropout_attention

    q, k, v = _qkv(T=7, S=9, grad=True)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., 6:] = False  # padding keys
    with torch.no_grad():
        torch.testing.assert_close(dropout_attention(q, k, v, mask, 0.0), reference_attention(q, k, v, mask))
    torch.manual_seed(0)
    ones = torch.ones_like(v)
    out = dropout_attention(torch.zeros_like(q), torch.zeros_like(k), ones, mask, 0.5)  # weights 1/n, half dropped
    assert not torch.allclose(out, torch.ones_like(out)) and out.mean().item() == pytest.approx(1.0, abs=0.15)
    kernels.attend(q, k, v, mask, dropout_p=0.1, causal=False).sum().backward()  # the training path differentiates
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("draw", ["c", "torch.rand"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_dropout_keeps_one_minus_p_and_scales_like_torchs(dtype, draw, monkeypatch):
    from frawdllm.model.kernels import dropout

    if draw == "c" and kernels._dropout_library() is None:
        pytest.skip("no C compiler: the C dropout kernel is unavailable")
    if draw == "torch.rand":
        monkeypatch.setattr(kernels, "_dropout_library", lambda: None)
    torch.manual_seed(0)
    x = torch.ones(400, 500, dtype=dtype, requires_grad=True)
    y = dropout(x, 0.1)
    kept = y != 0
    assert y.dtype == dtype and kept.float().mean().item() == pytest.approx(0.9, abs=0.003)
    assert torch.equal(y[kept], torch.nn.functional.dropout(torch.ones(10, dtype=dtype), 0.1, training=False)[0]
                       .div(0.9).expand(int(kept.sum())))  # 1 / (1 - p), rounded as F.dropout rounds it
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient goes through the kept elements, scaled
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0) is x


def test_c_dropout_masks_follow_torchs_seed_and_not_the_thread_count():
    if kernels._dropout_library() is None:
        pytest.skip("no C compiler: the C dropout kernel is unavailable")
    x = torch.ones(1001, 37)  # odd: the last element has no pair
    threads = torch.get_num_threads()
    masks = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            torch.manual_seed(5)
            masks.append(kernels.dropout(x, 0.25))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(kernels.dropout(x, 0.25), masks[0])  # the next draw differs
    kept = masks[0] != 0
    assert kept.float().mean().item() == pytest.approx(0.75, abs=0.01) and kept[-1].any()
