"""The training criterion: label-smoothed cross-entropy (Szegedy et al. 2016; paper §5.4), a pure function of
logits and targets, with its gradient written in closed form."""

from __future__ import annotations

import torch

ROWS_PER_PASS = 64  # a (64, 8000) fp32 block is 2 MB: the softmax's passes over it stay in cache


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token label-smoothed cross-entropy and NLL from logits (N,V), with the gradient written in closed form.

    Why not log_softmax + gather + mean under autograd: on a CPU that chain makes ~6 passes over the (N,V) logits
    forward and backward (the softmax, the mean's expanded gradient, the gather's zero-filled gradient, their sum,
    the softmax backward); here the forward is one logsumexp and the backward one exp plus in-place updates:
    d/dz [(1-eps)(lse - z_y) + eps(lse - mean z)] = softmax(z) - (1-eps) onehot(y) - eps/V.
    Both work on blocks of ROWS_PER_PASS rows in fp32, whatever the logits' dtype: bf16/fp16 logits are neither
    copied to fp32 as a whole nor is their gradient, which made those copies a third of a bf16 step."""

    @staticmethod
    def forward(ctx, logits, target, epsilon: float):
        dtype = _stats_dtype(logits)
        lse = torch.empty(logits.size(0), dtype=dtype, device=logits.device)  # (N,)
        for rows in _blocks(logits.size(0)):
            torch.logsumexp(logits[rows].to(dtype), dim=-1, out=lse[rows])
        nll = lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).to(dtype)  # (N,)
        smooth = lse - logits.mean(dim=-1, dtype=dtype)  # (N,): cross-entropy against the uniform distribution
        ctx.save_for_backward(logits, target, lse)
        ctx.epsilon = epsilon
        return (1.0 - epsilon) * nll + epsilon * smooth, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target, lse = ctx.saved_tensors
        eps, v = ctx.epsilon, logits.size(-1)
        g_loss = grad_loss if grad_loss is not None else torch.zeros_like(lse)  # (N,)
        g_nll = grad_nll if grad_nll is not None else torch.zeros_like(lse)  # (N,)
        scale, uniform = (g_loss + g_nll).unsqueeze(-1), ((eps / v) * g_loss).unsqueeze(-1)  # (N,1) each
        onehot = (-((1.0 - eps) * g_loss + g_nll)).unsqueeze(-1)  # (N,1)
        grad = torch.empty_like(logits)  # (N,V)
        direct = logits.dtype == lse.dtype
        for rows in _blocks(logits.size(0)):
            block = grad[rows] if direct else torch.empty(grad[rows].shape, dtype=lse.dtype, device=grad.device)
            torch.sub(logits[rows], lse[rows].unsqueeze(-1), out=block).exp_()  # softmax
            block.mul_(scale[rows]).sub_(uniform[rows])
            block.scatter_add_(-1, target[rows].unsqueeze(-1), onehot[rows])
            if not direct:
                grad[rows].copy_(block)
        return grad, None, None


def _stats_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16 logits (autocast output), else the logits' own dtype (fp32, fp64 in gradcheck)."""
    return torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


def _blocks(n: int) -> list[slice]:
    return [slice(i, min(i + ROWS_PER_PASS, n)) for i in range(0, n, ROWS_PER_PASS)]


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over non-pad tokens of (1-eps)*NLL + eps*(mean NLL over the vocabulary) (Szegedy et al. 2016; paper §5.4).

    logits (B,T,V), target (B,T), or logits (N,V), target (N,) already without padding; bf16/fp16 logits (autocast)
    are read as they are and their statistics computed in fp32.
    Returns (smoothed loss sum, plain NLL sum): fp32 scalars (fp64 for fp64 logits)."""
    logits = logits.flatten(0, -2)  # (B,T,V) -> (B*T,V); (N,V) stays
    target = target.flatten()  # (B,T) -> (B*T,)
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, epsilon)  # (B*T,) or (N,) each
    pad = target.eq(pad_id)
    return loss.masked_fill(pad, 0.0).sum(), nll.masked_fill(pad, 0.0).sum()
