"""The fused CPU attention for training (`model/cpu_attention.c`), bf16 (AVX512-BF16 CPUs)
and fp32 (any CPU): values, gradients, layouts, threads, the operator registration, and
when `attend` uses it."""

import pytest
import torch
import torch.nn.functional as F

from frawdllm.model import cpu_attention
from frawdllm.model.kernels import attend

needs_bf16 = pytest.mark.skipif(not cpu_attention.available(), reason="needs a C compiler and a CPU with AVX512-BF16")
needs_c = pytest.mark.skipif(not cpu_attention.f32_columns(), reason="needs a C compiler")


def bf16_inputs(B, H, T, hd, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, hd, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(B, H, T, hd, generator=gen).bfloat16()


def fp32_reference(q, k, v, dout):
    """Causal attention and its gradients in fp32 (PyTorch's SDPA) on the same bf16 inputs."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    return (out, *torch.autograd.grad(out, (qf, kf, vf), dout.float()))


def assert_bf16_close(ours, ref, tol=0.02):
    """Within 2% of the largest magnitude: bf16 keeps 8 bits (0.4%); PyTorch's own bf16
    attention lands at 0.2-0.7% on these inputs, a wrong mask or term at 10-100%."""
    assert ours.dtype == torch.bfloat16
    err = (ours.float() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item() + 1e-6, f"max error {err} against max {ref.abs().max().item()}"


@pytest.mark.parametrize("B, H, T, hd", [(2, 3, 37, 32), (1, 2, 8, 64), (2, 2, 100, 64), (1, 1, 1, 32),
                                         (1, 4, 64, 32), (1, 2, 300, 32), (1, 1, 33, 96)])
@needs_bf16
def test_values_and_gradients_equal_fp32_attention_to_bf16_precision(B, H, T, hd):
    q, k, v, dout = bf16_inputs(B, H, T, hd)
    out = cpu_attention.causal_attention(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for ours, ref in zip((out, *grads), fp32_reference(q, k, v, dout)):
        assert_bf16_close(ours, ref)


@needs_bf16
def test_the_saved_logsumexp_is_that_of_the_scaled_causal_scores():
    q, k, v, _ = bf16_inputs(2, 2, 45, 32)
    _, lse = torch.ops.frawdllm.causal_attention(q, k, v)
    scores = (q.float() @ k.float().transpose(-1, -2)) / 32**0.5
    scores = scores.masked_fill(~torch.ones(45, 45, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-6, atol=2e-6)


@needs_bf16
def test_the_future_does_not_reach_the_past():
    q, k, v, dout = bf16_inputs(1, 2, 70, 32)
    out = cpu_attention.causal_attention(q, k, v)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 50:], v2[:, :, 50:] = 7.0, -3.0  # change keys and values from position 50 on
    out2 = cpu_attention.causal_attention(q, k2, v2)
    assert torch.equal(out[:, :, :50], out2[:, :, :50]) and not torch.equal(out[:, :, 50:], out2[:, :, 50:])
    dq = torch.autograd.grad(out[:, :, :50], q, dout[:, :, :50])[0]  # no gradient flows from rows < 50 ...
    assert torch.equal(dq[:, :, 50:], torch.zeros_like(dq[:, :, 50:]))
    dk = torch.autograd.grad(cpu_attention.causal_attention(q, k, v)[:, :, :50], k, dout[:, :, :50])[0]
    assert torch.equal(dk[:, :, 50:], torch.zeros_like(dk[:, :, 50:]))  # ... into later keys


@needs_bf16
def test_strided_views_of_a_fused_qkv_give_the_same_bits_as_contiguous_inputs():
    B, T, H, hd = 2, 40, 3, 32
    qkv = torch.randn(B, T, 3, H, hd).bfloat16()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, hd) views, as the model passes them
    dout = torch.randn(B, H, T, hd).bfloat16()
    strided = [t.requires_grad_() for t in (q, k, v)]
    contiguous = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    a, b = cpu_attention.causal_attention(*strided), cpu_attention.causal_attention(*contiguous)
    assert torch.equal(a, b)
    assert a.transpose(1, 2).is_contiguous()  # stored as (B, T, H, hd): back to (B, T, D) without a copy
    for ga, gb in zip(torch.autograd.grad(a, strided, dout), torch.autograd.grad(b, contiguous, dout)):
        assert torch.equal(ga, gb)
    strided_dout = dout.transpose(1, 2).contiguous().transpose(1, 2)  # a strided output gradient too
    assert torch.equal(torch.autograd.grad(cpu_attention.causal_attention(*strided), strided, strided_dout)[0],
                       torch.autograd.grad(cpu_attention.causal_attention(*contiguous), contiguous, dout)[0])


@needs_bf16
def test_one_thread_and_two_give_the_same_bits():
    q, k, v, dout = bf16_inputs(3, 2, 50, 32)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = cpu_attention.causal_attention(q, k, v)
            results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16),
                                   pytest.param(torch.float32, marks=needs_c)])
def test_the_operator_passes_torch_library_opcheck(dtype):
    q, k, v = (torch.randn(2, 2, 20, 32, dtype=dtype).requires_grad_() for _ in range(3))
    torch.library.opcheck(torch.ops.frawdllm.causal_attention.default, (q, k, v))


@pytest.fixture
def kernel_calls(monkeypatch):
    """(calls, kernel): an entry per call `attend` makes to the kernel (which still runs), and
    the kernel itself, uncounted."""
    calls = []
    kernel = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(1) or kernel(*a))
    return calls, kernel


@needs_bf16
def test_attend_uses_the_bf16_kernel_when_training_in_bf16(kernel_calls):
    calls, kernel = kernel_calls
    q, k, v, _ = bf16_inputs(1, 2, 16, 32)
    assert torch.equal(attend(q, k, v), kernel(q, k, v)) and len(calls) == 1
    with torch.no_grad():  # inference: PyTorch's attention
        attend(q, k, v)
    attend(q, k, v, dropout_p=0.1)  # the kernel has no dropout
    attend(q[..., :16], k[..., :16], v[..., :16])  # head_dim not a multiple of 32
    assert len(calls) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 inputs (after RoPE, say) under bf16 autocast
        out = attend(q.float(), k.float(), v.float())
    assert len(calls) == 2 and out.dtype == torch.bfloat16
    assert attend(q.float(), k.float(), v.float()).dtype == torch.float32  # fp32 training: the fp32 kernel
    assert len(calls) == 3


@needs_bf16
def test_grouped_query_attention_gets_the_gradients_of_the_shared_heads():
    q, _, _, dout = bf16_inputs(1, 4, 24, 32)
    k, v = (torch.randn(1, 2, 24, 32).bfloat16().requires_grad_() for _ in range(2))  # 2 kv heads for 4 queries
    out = attend(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    kf, vf = (t.detach().float().repeat_interleave(2, dim=1).requires_grad_() for t in (k, v))
    qf = q.detach().float().requires_grad_()
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    assert_bf16_close(out, ref)
    assert_bf16_close(grads[0], ref_grads[0])
    for ours, theirs in zip(grads[1:], ref_grads[1:]):  # each kv head sums the grads of its two query heads
        assert_bf16_close(ours, theirs.unflatten(1, (2, 2)).sum(2))


COMPILE_SCRIPT = """
import torch
from torch.profiler import profile
from frawdllm import FrawdLLM, get_config
torch.manual_seed(0)
model = FrawdLLM(get_config("tiny", n_layer=2, vocab_size=300, context_length=64))
x, y = torch.randint(0, 300, (2, 2, 64))

def loss_and_grads(fn):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn(x, y)
    return [loss, *torch.autograd.grad(loss, list(model.parameters()))]

eager = loss_and_grads(lambda x, y: model(x, y)[1])
compiled_fn = torch.compile(lambda x, y: model(x, y)[1], fullgraph=True)  # no graph break around the operator
compiled = loss_and_grads(compiled_fn)
with profile() as prof:
    loss_and_grads(compiled_fn)
names = {e.name for e in prof.events()}
print(all(torch.allclose(a.float(), b.float(), atol=2e-3, rtol=2e-2) for a, b in zip(eager, compiled)),
      "frawdllm::causal_attention" in names, "frawdllm::causal_attention_backward" in names)
"""


@needs_bf16
def test_under_torch_compile_the_kernel_runs_inside_the_graph_and_equals_eager():
    # In a fresh interpreter: the test session's run-time type checks cannot be traced by dynamo.
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True", "True"]


def test_without_the_library_attend_keeps_pytorchs_attention(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_attention.LIBRARY, "_lib", None)
    monkeypatch.setattr(cpu_attention.LIBRARY, "_why_not", None)
    monkeypatch.setenv("FRAWD_NATIVE", "0")
    assert not cpu_attention.available()
    q, k, v, _ = bf16_inputs(1, 2, 16, 32)
    assert not cpu_attention.usable(q, k, v, 0.0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(attend(q, k, v), ref)


# ---- fp32: any CPU the C file compiles for ----------------------------------------------


def fp64_inputs(B, H, T, hd, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, hd, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(B, H, T, hd, generator=gen, dtype=torch.float64)


def assert_fp32_close(ours, ref, rtol=2e-6):
    """Within rtol of the float64 reference's largest magnitude (fp32 rounding: ~1e-7 here)."""
    assert ours.dtype == torch.float32
    err = (ours.double() - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item() + 1e-6, f"max error {err} against max {ref.abs().max().item()}"


@needs_c
@pytest.mark.parametrize("B, H, T, hd", [(2, 3, 37, 32), (1, 2, 8, 64), (2, 2, 100, 64), (1, 1, 1, 32),
                                         (1, 4, 64, 32), (1, 2, 300, 32), (1, 1, 33, 96), (2, 1, 7, 16)])
def test_fp32_values_and_gradients_equal_float64_attention(B, H, T, hd):
    q, k, v, dout = fp64_inputs(B, H, T, hd)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    if hd % cpu_attention.f32_columns():
        pytest.skip(f"head_dim {hd} is not a multiple of this CPU's tile width {cpu_attention.f32_columns()}")
    assert cpu_attention.usable(qf, kf, vf, 0.0)
    out = cpu_attention.causal_attention(qf, kf, vf)
    grads = torch.autograd.grad(out, (qf, kf, vf), dout.float())
    for ours, theirs in zip((out, *grads), (ref, *ref_grads)):
        assert_fp32_close(ours, theirs)


@needs_c
def test_fp32_logsumexp_and_causality():
    q, k, v, dout = (t.detach().float() for t in fp64_inputs(1, 2, 70, 32))
    out, lse = torch.ops.frawdllm.causal_attention(q, k, v)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 32**0.5
    scores = scores.masked_fill(~torch.ones(70, 70, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=1e-6, atol=2e-6)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:], v2[:, :, 50:] = 7.0, -3.0  # change keys and values from position 50 on
    q = q.requires_grad_()
    out2 = cpu_attention.causal_attention(q, k2, v2)
    assert torch.equal(out[:, :, :50], out2[:, :, :50]) and not torch.equal(out[:, :, 50:], out2[:, :, 50:])
    dq = torch.autograd.grad(out2[:, :, :50], q, dout[:, :, :50])[0]
    assert torch.equal(dq[:, :, 50:], torch.zeros_like(dq[:, :, 50:]))


@needs_c
def test_fp32_strided_views_and_thread_counts_give_the_same_bits():
    B, T, H, hd = 2, 40, 3, 32
    qkv = torch.randn(B, T, 3, H, hd)
    strided = [qkv[:, :, i].transpose(1, 2).requires_grad_() for i in range(3)]  # as the model passes them
    contiguous = [t.detach().contiguous().requires_grad_() for t in strided]
    dout = torch.randn(B, H, T, hd)
    results = []
    threads = torch.get_num_threads()
    try:
        for n, inputs in ((1, strided), (2, strided), (2, contiguous)):
            torch.set_num_threads(n)
            out = cpu_attention.causal_attention(*inputs)
            results.append((out, *torch.autograd.grad(out, inputs, dout)))
    finally:
        torch.set_num_threads(threads)
    assert results[0][0].transpose(1, 2).is_contiguous()  # stored as (B, T, H, hd)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@needs_c
def test_attend_uses_the_fp32_kernel_only_when_training_eagerly(kernel_calls):
    calls, kernel = kernel_calls
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    assert torch.equal(attend(q, k, v), kernel(q, k, v)) and len(calls) == 1
    with torch.no_grad():  # inference: PyTorch's attention
        attend(q, k, v)
    attend(q, k, v, dropout_p=0.1)  # the kernel has no dropout
    long = torch.randn(1, 1, cpu_attention.MAX_T_F32 + 1, 32)
    attend(long, long, long)  # past MAX_T_F32 PyTorch's flash kernel is faster
    narrow = q[..., :cpu_attention.f32_columns() // 2].contiguous()
    attend(narrow, narrow, narrow)  # a head narrower than the kernel's tile (it wrote past its buffers)
    assert len(calls) == 1
