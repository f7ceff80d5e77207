"""The training criterion: label-smoothed cross-entropy (Szegedy et al. 2016; paper §5.4), a pure function of
logits and targets, with its gradient written in closed form."""

from __future__ import annotations

import torch


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token label-smoothed cross-entropy and NLL from logits (N,V), with the gradient written in closed form.

    Why not log_softmax + gather + mean under autograd: on a CPU that chain makes ~6 passes over the (N,V) logits
    forward and backward (the softmax, the mean's expanded gradient, the gather's zero-filled gradient, their sum,
    the softmax backward); here the forward is one logsumexp and the backward one exp plus in-place updates:
    d/dz [(1-eps)(lse - z_y) + eps(lse - mean z)] = softmax(z) - (1-eps) onehot(y) - eps/V."""

    @staticmethod
    def forward(ctx, logits, target, epsilon: float):
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        nll = lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,)
        smooth = lse - logits.mean(dim=-1)  # (N,): cross-entropy against the uniform distribution
        ctx.save_for_backward(logits, target, lse)
        ctx.epsilon = epsilon
        return (1.0 - epsilon) * nll + epsilon * smooth, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target, lse = ctx.saved_tensors
        eps, v = ctx.epsilon, logits.size(-1)
        g_loss = grad_loss if grad_loss is not None else torch.zeros_like(lse)  # (N,)
        g_nll = grad_nll if grad_nll is not None else torch.zeros_like(lse)  # (N,)
        grad = (logits - lse.unsqueeze(-1)).exp_()  # (N,V) softmax
        grad.mul_((g_loss + g_nll).unsqueeze(-1)).sub_((eps / v) * g_loss.unsqueeze(-1))
        grad.scatter_add_(-1, target.unsqueeze(-1), -((1.0 - eps) * g_loss + g_nll).unsqueeze(-1))
        return grad, None, None


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over non-pad tokens of (1-eps)*NLL + eps*(mean NLL over the vocabulary) (Szegedy et al. 2016; paper §5.4).

    logits (B,T,V), target (B,T), or logits (N,V), target (N,) already without padding.
    Returns (smoothed loss sum, plain NLL sum): fp32 scalars (fp64 for fp64 logits)."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # autocast output: the softmax is computed in fp32
        logits = logits.float()
    logits = logits.flatten(0, -2)  # (B,T,V) -> (B*T,V); (N,V) stays
    target = target.flatten()  # (B,T) -> (B*T,)
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, epsilon)  # (B*T,) or (N,) each
    pad = target.eq(pad_id)
    return loss.masked_fill(pad, 0.0).sum(), nll.masked_fill(pad, 0.0).sum()
