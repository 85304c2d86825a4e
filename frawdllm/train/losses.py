"""The language-model loss, fused with the LM head: cross-entropy without the logits tensor.

The plain way, `F.cross_entropy(hidden @ W.T, targets)`, writes the logits (N x V: 67 MB
for 2048 tokens and a vocabulary of 8192 in fp32), reads them back for the softmax, and
the backward pass reads and writes them again. Here the tokens are processed in chunks
and the forward pass already computes the gradients, while a chunk's logits are hot in
cache:

    logits  = h @ W.T                     (n, V), one chunk of n tokens
    loss    = logsumexp(logits) - logits[target]
    dlogits = softmax(logits) - onehot(target)          the gradient of the loss
    dh      = dlogits @ W,   dW += dlogits.T @ h

The backward pass only scales the stored gradients. Same value and gradients as
`F.cross_entropy` (targets equal to -100 are ignored; the mean is over the others); the
matmuls run in the autocast dtype when autocast is on, the softmax in fp32.

Label smoothing eps (translation) aims at (1 - eps) on the target and eps / V on every
token instead of the one-hot target; the same pass gives it, and the plain cross-entropy
beside it as a metric (`linear_cross_entropy_and_nll`):

    loss    = (1 - eps) (lse - logits[target]) + eps (lse - mean(logits))
    dlogits = softmax(logits) - (1 - eps) onehot(target) - eps / V
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..model import IGNORE_INDEX

CHUNK_ELEMENTS = 2**22  # logits per chunk: 16 MB in fp32, about what a CPU cache holds


def _compute_dtype(t: Tensor) -> torch.dtype:
    device = t.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(hidden)
        acc = torch.promote_types(dtype, torch.float32)  # softmax and sums: fp32 at least
        h, w = hidden.to(dtype), weight.to(dtype)  # (N, D), (V, D)
        n_tokens, eps = hidden.shape[0], label_smoothing
        keep = targets != IGNORE_INDEX  # (N,)
        count = keep.sum().clamp(min=1)
        masked = torch.compiler.is_compiling() or not bool(keep.all())  # rows to zero (unknown in a graph)
        safe_targets = torch.where(keep, targets, 0)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        nll = torch.zeros((), dtype=acc, device=hidden.device)  # the unsmoothed loss (= loss when eps is 0)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for a in range(0, n_tokens, chunk):
            b = min(a + chunk, n_tokens)
            logits = (h[a:b] @ w.T).to(acc)  # (n, V)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (n, 1)
            target = safe_targets[a:b, None]  # (n, 1)
            mask = keep[a:b, None]
            if eps:
                chunk_nll = ((lse - logits.gather(1, target)) * mask).sum()
                smooth = ((lse - logits.mean(dim=-1, keepdim=True)) * mask).sum()
                nll = nll + chunk_nll
                loss = loss + (1 - eps) * chunk_nll + eps * smooth
                onehot = eps - 1
            else:
                loss = loss + ((lse - logits.gather(1, target)) * mask).sum()
                onehot = -1.0
            dlogits = logits.sub_(lse).exp_()  # softmax, in place: the logits are read for the last time
            if eps:
                dlogits.sub_(eps / logits.shape[1])
            dlogits = dlogits.scatter_add_(1, target, torch.full_like(lse, onehot))
            if masked:  # (a multiply by 1 everywhere otherwise: skipped, the same values)
                dlogits.mul_(mask)
            dlogits = dlogits.to(dtype)  # (n, V)
            grad_h[a:b] = dlogits @ w  # (n, D)
            grad_w += (dlogits.T @ h[a:b]).to(acc)  # (V, D)
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        nll = (nll if eps else loss) / count
        ctx.mark_non_differentiable(nll)
        return loss / count, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor | None = None):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count
        return (grad_h * scale).to(ctx.dtypes[0]), (grad_w * scale).to(ctx.dtypes[1]), None, None, None


def linear_cross_entropy(
    hidden: Float[Tensor, "N D"], weight: Float[Tensor, "V D"], targets: Int[Tensor, " N"],
    chunk: int | None = None,
) -> Float[Tensor, ""]:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` (-100 = ignored).

    `chunk`: tokens per chunk (default: about CHUNK_ELEMENTS logits on a CPU, all at once
    on a GPU, where one big matmul is what runs fast).
    """
    return linear_cross_entropy_and_nll(hidden, weight, targets, 0.0, chunk)[0]


def linear_cross_entropy_and_nll(
    hidden: Float[Tensor, "N D"], weight: Float[Tensor, "V D"], targets: Int[Tensor, " N"],
    label_smoothing: float = 0.0, chunk: int | None = None,
) -> tuple[Float[Tensor, ""], Float[Tensor, ""]]:
    """The mean label-smoothed cross-entropy (as `F.cross_entropy(..., label_smoothing=)`)
    and, without a gradient, the mean plain cross-entropy of the same logits."""
    if chunk is None:
        chunk = hidden.shape[0] if hidden.device.type == "cuda" else max(16, CHUNK_ELEMENTS // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, label_smoothing)
