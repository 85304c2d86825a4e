"""The fused fp32 training kernels (`model/cpu_fused.c`): RMSNorm, RoPE and SwiGLU against
float64 references, gradients included; thread counts; when the model uses them."""

import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from frawdllm import FrawdLLM, get_config
from frawdllm.cbuild import CFLAGS
from frawdllm.model import cpu_attention, cpu_fused
from frawdllm.model.embeddings import apply_rope, rope_tables

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="needs a C compiler")


def assert_close_to_reference(ours, ref, rtol=2e-6):
    """Within rtol of the reference's largest magnitude (fp32 rounding is ~1e-7 here; a
    wrong term or index is off by far more)."""
    assert ours.dtype == torch.float32
    err = (ours.double() - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item() + 1e-7, f"max error {err} against max {ref.abs().max().item()}"


def fp64(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
            ).requires_grad_()


def as_fp32(*tensors):
    return [t.detach().float().requires_grad_() for t in tensors]


@pytest.mark.parametrize("shape", [(32, 64, 128), (3, 7, 37), (2, 5), (4, 1)])
def test_rms_norm_and_its_gradients_equal_float64(shape):
    x, w, gy = fp64(*shape), fp64(shape[-1], seed=1), fp64(*shape, seed=2).detach()
    ref = F.rms_norm(x, (shape[-1],), w, 1e-5)
    ref_grads = torch.autograd.grad(ref, (x, w), gy)
    xf, wf = as_fp32(x, w)
    assert cpu_fused.usable(xf, wf)
    out = cpu_fused.rms_norm(xf, wf, 1e-5)
    grads = torch.autograd.grad(out, (xf, wf), gy.float())
    for ours, theirs in zip((out, *grads), (ref, *ref_grads)):
        assert_close_to_reference(ours, theirs, rtol=2e-5 if shape[-1] == 1 else 2e-6)


def reference_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("B, T, H, hd", [(2, 10, 3, 32), (1, 5, 2, 6), (2, 64, 4, 64), (1, 3, 1, 34)])
def test_rope_on_views_of_a_fused_qkv_and_its_gradient_equal_float64(B, T, H, hd):
    qkv = fp64(B, T, 3, H, hd)
    cos, sin = rope_tables(T, hd, 10000.0)
    ref = reference_rope(qkv[:, :, 1].transpose(1, 2), cos.double(), sin.double())  # k: a (B, H, T, hd) view
    gy = torch.randn_like(ref)
    ref_grad = torch.autograd.grad(ref, qkv, gy)[0]
    (qkv32,) = as_fp32(qkv)
    k = qkv32[:, :, 1].transpose(1, 2)
    assert cpu_fused.rope_usable(k, cos, sin)
    out = apply_rope(k, cos, sin)  # the model's entry point takes the fused kernel here
    assert out.transpose(1, 2).is_contiguous()  # back to (B, T, D) without a copy
    assert_close_to_reference(out, ref)
    assert_close_to_reference(torch.autograd.grad(out, qkv32, gy.float())[0], ref_grad)


@pytest.mark.parametrize("shape", [(32, 64, 704), (3, 5, 22), (1, 2)])
def test_swiglu_and_its_gradient_equal_float64(shape):
    h, gy = fp64(*shape, scale=4.0), fp64(*shape[:-1], shape[-1] // 2, seed=1).detach()
    gate, up = h.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    ref_grad = torch.autograd.grad(ref, h, gy)[0]
    (h32,) = as_fp32(h)
    out = cpu_fused.swiglu(h32)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(torch.autograd.grad(out, h32, gy.float())[0], ref_grad)


def test_strided_inputs_and_expanded_gradients_equal_float64():
    """Called on a transposed tensor, or backpropagated from `.sum()` (a stride-0 gradient),
    the kernels read what the tensors hold, not their storage in order."""
    x, w = fp64(16, 8), fp64(16, seed=1)
    ref = F.rms_norm(x.t(), (16,), w, 1e-5)
    ref_grad = torch.autograd.grad(ref.sum(), x)[0]
    xf, wf = as_fp32(x, w)
    out = cpu_fused.rms_norm(xf.t(), wf, 1e-5)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(torch.autograd.grad(out.sum(), xf)[0], ref_grad)
    base = fp64(2, 3, 8, 10)  # rope on a (B, H, T, hd) view whose last dimension is not contiguous
    cos, sin = rope_tables(10, 8, 10000.0)
    ref = reference_rope(base.transpose(-1, -2), cos.double(), sin.double())
    (base32,) = as_fp32(base)
    assert_close_to_reference(cpu_fused.rope(base32.transpose(-1, -2), cos, sin), ref)


def test_one_thread_and_two_give_the_same_bits():
    x, w = as_fp32(fp64(300, 96), fp64(96, seed=1))  # 300 rows: RMSNorm's weight gradient sums 5 chunks
    h = as_fp32(fp64(300, 2 * 44, seed=2))[0]
    qkv = as_fp32(fp64(2, 40, 3, 2, 32, seed=3))[0]
    cos, sin = rope_tables(40, 32, 10000.0)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs = (cpu_fused.rms_norm(x, w, 1e-5), cpu_fused.swiglu(h),
                    cpu_fused.rope(qkv[:, :, 0].transpose(1, 2), cos, sin))
            grads = torch.autograd.grad(sum(o.square().sum() for o in outs), (x, w, h, qkv))
            results.append((*outs, *grads))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_kernels_are_used_only_for_fp32_training_outside_compile_and_autocast():
    x, w = as_fp32(fp64(2, 8), fp64(8, seed=1))
    assert cpu_fused.usable(x, w)
    with torch.no_grad():  # inference keeps PyTorch's ops (the engine has its own forward)
        assert not cpu_fused.usable(x, w)
    assert not cpu_fused.usable(x.bfloat16(), w)
    assert not cpu_fused.usable(x.double(), w.double())  # (the kernels read fp32 only)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_fused.usable(x, w)
    cos, sin = rope_tables(8, 2, 10000.0)
    q = x.view(2, 1, 8, 1).expand(2, 1, 8, 2)
    assert cpu_fused.rope_usable(q, cos, sin) and cpu_fused.rope_usable(q, cos[None, None], sin[None, None])
    positions = cos[None, None].expand(2, 1, 8, 1)  # per-row positions (B, 1, T, hd/2): not the kernel's case
    assert not cpu_fused.rope_usable(q, positions, positions)


def llama_model():
    cfg = get_config("tiny", n_layer=2, n_head=4, n_embd=64, context_length=32, vocab_size=50,
                     use_rope=True, use_rmsnorm=True, use_swiglu=True, bias=False, dropout=0.0)
    torch.manual_seed(0)
    return FrawdLLM(cfg)


def test_a_training_step_with_the_kernels_equals_pytorchs_ops(monkeypatch):
    model = llama_model()
    x, y = torch.randint(0, 50, (2, 3, 32), generator=torch.Generator().manual_seed(1))
    calls = []
    for name in ("rms_norm", "rope", "swiglu"):
        kernel = getattr(cpu_fused, name)
        monkeypatch.setattr(cpu_fused, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))

    def loss_and_grads():
        loss = model(x, y)[1]
        return [loss, *torch.autograd.grad(loss, list(model.parameters()))]

    fused = loss_and_grads()
    assert sorted(set(calls)) == ["rms_norm", "rope", "swiglu"]
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    calls.clear()
    plain = loss_and_grads()
    assert calls == []
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_without_the_library_the_model_keeps_pytorchs_ops(monkeypatch):
    monkeypatch.setattr(cpu_fused.LIBRARY, "_lib", None)
    monkeypatch.setattr(cpu_fused.LIBRARY, "_why_not", None)
    monkeypatch.setenv("FRAWD_NATIVE", "0")
    assert not cpu_fused.available()
    model = llama_model()
    x, y = torch.randint(0, 50, (2, 2, 32))
    loss = model(x, y)[1]
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None,
                    reason="no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("library", [cpu_fused.LIBRARY, cpu_attention.LIBRARY], ids=["cpu_fused", "cpu_attention"])
def test_the_training_kernels_compile_for_aarch64_without_warnings(library, tmp_path):
    result = subprocess.run(["aarch64-linux-gnu-gcc", *CFLAGS, "-march=armv8.2-a", "-Wall", "-Wno-psabi",
                             str(library.source), "-o", str(tmp_path / "kernels.so"), "-lm"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
