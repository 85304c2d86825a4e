"""Speed paths used in training must compute the same function as the plain ones."""

import pytest
import torch
import torch.nn.functional as F

from frawdllm.model.kernels import blocked_causal_attention


@pytest.mark.parametrize("T, n_blocks", [(64, 4), (7, 4), (33, 4), (256, 4), (16, 1), (10, 3)])
def test_blocked_causal_attention_equals_sdpa_values_and_gradients(T, n_blocks):
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, 3, T, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, T, 8, generator=gen, dtype=torch.float64)
    ours = blocked_causal_attention(q, k, v, n_blocks=n_blocks)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_blocked_causal_attention_in_bf16_stays_close_to_fp32():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=gen) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    low = blocked_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
    assert (low - ref).abs().max() < 0.05


def test_blocked_causal_attention_dropout_zeroes_some_weights_and_keeps_the_mean():
    torch.manual_seed(0)
    q, k = torch.zeros(1, 1, 64, 8), torch.zeros(1, 1, 64, 8)
    v = torch.ones(1, 1, 64, 8)
    out = blocked_causal_attention(q, k, v, dropout_p=0.5)  # uniform weights, half dropped, rest x2
    assert not torch.allclose(out, torch.ones_like(out))
    assert out.mean().item() == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 300, None])
def test_linear_cross_entropy_equals_cross_entropy_of_logits(chunk):
    from frawdllm.train.losses import linear_cross_entropy

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(300, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (300,), generator=gen)
    targets[::7] = -100  # ignored positions (padding)
    ours = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    ours_grads = torch.autograd.grad(2.5 * ours, (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    ref_grads = torch.autograd.grad(2.5 * ref, (hidden, weight))
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [7, None])
@pytest.mark.parametrize("eps", [0.1, 0.5])
def test_label_smoothed_linear_cross_entropy_equals_torchs_and_gives_the_plain_nll(eps, chunk):
    from frawdllm.train.losses import linear_cross_entropy_and_nll

    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(120, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (120,), generator=gen)
    targets[::5] = -100
    loss, nll = linear_cross_entropy_and_nll(hidden, weight, targets, eps, chunk=chunk)
    grads = torch.autograd.grad(3.0 * loss, (hidden, weight))
    logits = hidden @ weight.T
    ref = F.cross_entropy(logits, targets, ignore_index=-100, label_smoothing=eps)
    ref_grads = torch.autograd.grad(3.0 * ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(nll, F.cross_entropy(logits.detach(), targets, ignore_index=-100),
                               rtol=1e-12, atol=1e-12)
    assert not nll.requires_grad
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_translation_training_loss_equals_the_models_own_label_smoothed_loss():
    from frawdllm import Seq2SeqTransformer, get_config
    from frawdllm.train.translation import TranslationTask, collate, translation_loss, translation_loss_and_nll

    torch.manual_seed(0)
    model = Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=2, n_layer=2,
                                          n_encoder_layer=1, mlp_hidden=64, dropout=0.0)).double()
    rng = torch.Generator().manual_seed(3)
    pairs = [(torch.randint(4, 60, (n,), generator=rng).tolist(), torch.randint(4, 60, (m,), generator=rng).tolist())
             for n, m in [(5, 7), (9, 3), (2, 11), (6, 6)]]  # ragged: padding on both sides
    batch = collate(pairs)
    params = list(model.parameters())
    loss, metrics = translation_loss_and_nll(model, batch, 0.1)
    grads = torch.autograd.grad(loss, params)
    logits = model.decode(batch["tgt_in"], model.memory_kv(model.encode(batch["src"], batch["src_mask"])),
                          batch["src_mask"]).flatten(0, 1)  # (B T, V), in fp64 here
    labels = batch["labels"].flatten()
    ref = F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.1)
    ref_grads = torch.autograd.grad(ref, params, retain_graph=True)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["nll"], F.cross_entropy(logits, labels, ignore_index=-100),
                               rtol=1e-12, atol=1e-12)
    assert translation_loss(model, batch, 0.1).item() == pytest.approx(ref.item(), rel=1e-6)  # the model's own
    task = TranslationTask(model.config, None, pairs, None, tokens_per_batch=64, label_smoothing=0.1)
    torch.testing.assert_close(task.loss(model, batch)[0], ref, rtol=1e-12, atol=1e-12)  # one process: the mean
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_pretraining_loss_equals_the_models_own_loss_under_bf16_autocast():
    from frawdllm import FrawdLLM, get_config
    from frawdllm.train.losses import linear_cross_entropy

    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=300, context_length=16))
    x, y = torch.randint(0, 300, (2, 2, 16))
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_cross_entropy(model.hidden_states(x).flatten(0, 1), model.lm_head.weight, y.flatten())
        fused_grads = torch.autograd.grad(fused, params)
        plain = model(x, y)[1]
        plain_grads = torch.autograd.grad(plain, params)
    assert fused.dtype == torch.float32
    assert fused.item() == pytest.approx(plain.item(), abs=2e-3)
    for a, b in zip(fused_grads, plain_grads):
        assert (a - b).abs().max() < 2e-3 * max(1.0, b.abs().max().item())


def test_gelu_through_sigmoid_equals_torch_tanh_gelu():
    from frawdllm.model.mlp import gelu_tanh_via_sigmoid

    x = torch.linspace(-12, 12, 20001, dtype=torch.float64)
    torch.testing.assert_close(gelu_tanh_via_sigmoid(x), F.gelu(x, approximate="tanh"), rtol=1e-12, atol=1e-14)
    bf = x.to(torch.bfloat16)
    assert gelu_tanh_via_sigmoid(bf).dtype == torch.bfloat16
    torch.testing.assert_close(gelu_tanh_via_sigmoid(bf).float(), F.gelu(bf.float(), approximate="tanh"),
                               rtol=1e-2, atol=1e-2)
