"""Cross entropy of a linear head, ``chunk_size`` tokens at a time: never (tokens x vocab) logits at once.

The plain path (``F.cross_entropy(lm_head(h).float(), labels)``) holds the logits of every token of the
batch in the compute dtype, their fp32 copy, and the fp32 softmax the backward needs: at GPT-2's 50257
words and 16 x 1024 tokens that is ~3.3 GB per fp32 copy, and passes over it that cost time on a GPU (issue
28: mixprec's step was 0.85x nanoGPT's, which does not copy the logits to fp32 itself). Here each chunk of
tokens makes its logits, its loss and, when gradients are wanted, its gradients right away (the softmax
minus the one-hot target, into the head's two matmuls), and drops them: the forward keeps only the
gradient of the hidden states (tokens x width) and of the head's weight (fp32, vocab x width) for the
backward, which scales them by the incoming gradient. The same three matmuls as the plain path; the memory
of the logits falls to one chunk's.

Numerics follow autocast's: the matmuls in the autocast dtype (or the weight's, outside autocast), the
log-sum-exp and the softmax in fp32, the gradient of the logits cast to the compute dtype for its two
matmuls. The head's weight gradient is accumulated over chunks in fp32 (the plain path rounds it once to
the compute dtype), so the two agree to the compute dtype's rounding: tests/models/test_chunked_loss.py states the
tolerances.
"""

from __future__ import annotations

from typing import Any

import torch


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross entropy of ``hidden @ weight.T`` (``hidden``: (tokens, width), ``weight``: (rows, width))
    against ``labels`` (tokens,), the same value as ``F.cross_entropy(logits.float(), labels,
    ignore_index=ignore_index)``. Only the first ``vocab_size`` rows of ``weight`` are words (a vocabulary
    padded for aligned matmuls: the rest get no probability and no gradient); default: all of them.
    No host sync. Every label ``ignore_index``: NaN (0/0), as in PyTorch."""
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy(chunk_size={chunk_size!r}): must be >= 1")
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    vocab = weight.shape[0] if vocab_size is None else vocab_size
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_size, vocab, ignore_index, compute)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden, weight, labels, chunk_size, vocab, ignore_index, compute):  # noqa: ANN001
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes below are chosen, not autocast's
            w = weight.to(compute)
            grad_h = torch.empty_like(hidden) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            valid_count = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_size):
                h = hidden[start : start + chunk_size].to(compute)
                y = labels[start : start + chunk_size]
                logits = h @ w.t()  # (chunk, rows) in the compute dtype
                scores = logits[:, :vocab].float()
                lse = torch.logsumexp(scores, dim=1)
                valid = y != ignore_index
                target = torch.where(valid, y, 0).unsqueeze(1)
                picked = scores.gather(1, target).squeeze(1)
                total += torch.where(valid, lse - picked, 0.0).sum()
                valid_count += valid.sum()
                if not (want_h or want_w):
                    continue
                # d(sum of losses)/d(logits) = softmax - one-hot, 0 on ignored rows; into the logits' buffer
                probs = scores.sub_(lse.unsqueeze(1)).exp_()
                probs.scatter_add_(1, target, torch.full_like(picked, -1.0).unsqueeze(1))
                probs.mul_(valid.unsqueeze(1))
                logits[:, :vocab].copy_(probs)
                logits[:, vocab:].zero_()  # padded rows: no probability, no gradient
                if want_h:
                    grad_h[start : start + chunk_size] = logits @ w
                if want_w:
                    grad_w += (logits.t() @ h).float()
        ctx.save_for_backward(grad_h, grad_w, valid_count)
        ctx.weight_dtype = weight.dtype
        return total / valid_count

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # noqa: ANN205
        grad_h, grad_w, valid_count = ctx.saved_tensors
        scale = grad_out / valid_count  # the mean's 1/n and the incoming gradient, one fp32 scalar
        dh = None if grad_h is None else (grad_h * scale).to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * scale).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None
