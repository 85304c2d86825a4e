"""int8 weight-only quantization: rounding within half a step, the layer equals its
dequantized weight, a quantized model stays close to fp32 and runs in the engine."""

import pytest
import torch
from torch import nn

from frawdllm import FrawdLLM, get_config
from frawdllm.infer import Engine, SamplingParams
from frawdllm.infer.quantize import Int8Linear, int8_weight_bytes, quantize_int8, quantize_rows
from frawdllm.infer.native import available as native_available
from frawdllm.infer.native import dequantized_copy
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)


def test_per_row_rounding_error_is_at_most_half_a_step():
    weight = torch.randn(64, 48) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scales
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    assert torch.equal(q.abs().amax(dim=1), torch.full((64,), 127, dtype=torch.int8))  # each row uses the range
    error = (q.float() * scale[:, None] - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7 * weight.abs()).all())


@pytest.mark.parametrize("in_features", [64, 40], ids=["cpu-kernel", "dequantize"])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_equals_its_dequantized_weight(in_features, bias):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 24, bias=bias)
    layer = Int8Linear(linear)
    assert layer.use_kernel == (in_features % 16 == 0)
    x = torch.randn(3, 5, in_features)
    reference = nn.functional.linear(x, layer.dequantized_weight(), linear.bias)
    out = layer(x)
    assert out.shape == (3, 5, 24) and out.dtype == torch.float32
    # The CPU kernel rounds activations to bf16 (relative 2^-8); the fallback is exact fp32.
    tol = 2e-2 if layer.use_kernel else 1e-5
    torch.testing.assert_close(out, reference, atol=tol * reference.abs().max().item(), rtol=0)
    # And it is close to the float layer: the int8 error is about 1% of the outputs' scale.
    full = linear(x).detach()
    assert (out - full).abs().max() < 0.03 * full.abs().max()


def test_quantized_model_replaces_every_linear_and_stays_close():
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", vocab_size=300, n_layer=2, n_embd=64, n_head=4, context_length=64)).eval()
    ids = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        reference = model(ids)[0]
        embedding = model.embed.tok.weight.clone()
        before = int8_weight_bytes(model)
        quantize_int8(model)
        out = model(ids)[0]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.embed.tok.weight, embedding)  # the (tied) embedding table stays exact
    stored, fp32 = int8_weight_bytes(model)
    assert before == (fp32, fp32) and stored < 0.27 * fp32
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert stored == sum(m.weight_int8.numel() + 4 * m.weight_int8.shape[0] for m in linears)  # a byte each, a scale a row
    assert ((out - reference).norm() / reference.norm()) < 0.05
    agree = (out.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree > 0.8


def test_quantized_model_generates_through_the_engine():
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny-llama", vocab_size=300, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                                context_length=64)).eval()
    quantize_int8(model)

    class Ids:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    for engine in (Engine(model, Ids()), Engine(model, Ids(), native=False)):
        # Native: int8 weights x fp32 activations, i.e. the dequantized model in fp32.
        # PyTorch: the Int8Linear modules themselves (bf16 activations in the CPU kernel).
        ref = dequantized_copy(model) if engine.native else model
        out = engine.generate([[5, 6, 7]], params)[0]
        assert out.tokens == naive_greedy(ref, [5, 6, 7], 10)
    assert Engine(model, Ids()).native == native_available()  # int8 models decode natively when they can


def naive_greedy(model, seq, n):
    naive, seq = [], list(seq)
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([seq]))[0][0, -1].argmax())
            seq.append(token)
            naive.append(token)
    return naive
