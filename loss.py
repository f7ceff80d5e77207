"""The training criterion: label-smoothed cross-entropy (Szegedy et al. 2016; paper §5.4), a pure function of
logits and targets, with its gradient written in closed form; and the same loss fused with the pre-softmax
projection of §3.4, which is how the trainer computes it."""

from __future__ import annotations

import torch
from torch import nn

from runtime import cpu_info

ROWS_PER_PASS = 64  # a (64, 8000) fp32 block is 2 MB: the softmax's passes over it stay in cache


def _softmax_stats(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                   probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token smoothed loss and NLL (N,) of logits (N,V); writes softmax(logits) into probs (N,V), which may be
    logits itself (fp32 logits nobody else reads): the backward then starts from it instead of a second exp."""
    n, dtype = logits.size(0), probs.dtype  # fp32 for bf16/fp16 logits (autocast output), else the logits' own
    z_target, z_mean, top, total = (torch.empty(n, 1, dtype=dtype, device=logits.device) for _ in range(4))
    for rows in _blocks(n):  # every pass over a block but the first and the last hits the cache, not memory
        block = logits[rows].to(dtype)  # the block itself when the dtypes agree
        torch.gather(block, -1, target[rows].unsqueeze(-1), out=z_target[rows])  # before any overwrite
        torch.mean(block, dim=-1, keepdim=True, out=z_mean[rows])
        torch.amax(block, dim=-1, keepdim=True, out=top[rows])  # exp never overflows
        p = torch.sub(block, top[rows], out=probs[rows]).exp_()
        torch.sum(p, dim=-1, keepdim=True, out=total[rows])
        p.div_(total[rows])
    lse = (top + total.log()).squeeze(-1)  # (N,)
    nll = lse - z_target.squeeze(-1)
    return (1.0 - epsilon) * nll + epsilon * (lse - z_mean.squeeze(-1)), nll  # smooth: cross-entropy vs uniform


def _logits_grad(probs: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor | None,
                 grad_nll: torch.Tensor | None, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    """d/dz [(1-eps)(lse - z_y) + eps(lse - mean z)] = softmax(z) - (1-eps) onehot(y) - eps/V, weighted by the
    incoming gradients of the two outputs; (N,V) in `dtype`, computed in probs' memory when the dtypes agree."""
    v = probs.size(-1)
    zeros = torch.zeros(probs.size(0), dtype=probs.dtype, device=probs.device)
    g_loss = grad_loss if grad_loss is not None else zeros  # (N,)
    g_nll = grad_nll if grad_nll is not None else zeros  # (N,)
    scale, uniform = (g_loss + g_nll).unsqueeze(-1), ((epsilon / v) * g_loss).unsqueeze(-1)  # (N,1) each
    onehot = (-((1.0 - epsilon) * g_loss + g_nll)).unsqueeze(-1)  # (N,1)
    direct = dtype == probs.dtype
    grad = probs if direct else torch.empty(probs.shape, dtype=dtype, device=probs.device)
    for rows in _blocks(probs.size(0)):
        block = probs[rows].mul_(scale[rows]).sub_(uniform[rows])
        block.scatter_add_(-1, target[rows].unsqueeze(-1), onehot[rows])
        if not direct:
            grad[rows].copy_(block)
    return grad


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token label-smoothed cross-entropy and NLL from logits (N,V), with the gradient written in closed form.

    Why not log_softmax + gather + mean under autograd: on a CPU that chain makes ~6 passes over the (N,V) logits
    forward and backward (the softmax, the mean's expanded gradient, the gather's zero-filled gradient, their sum,
    the softmax backward); here the softmax is computed once, on blocks of ROWS_PER_PASS rows in fp32 whatever
    the logits' dtype (bf16 logits are neither copied to fp32 as a whole nor is their gradient), and kept for the
    backward, which turns it into the gradient in place."""

    @staticmethod
    def forward(ctx, logits, target, epsilon: float):
        probs = torch.empty(logits.shape, dtype=_stats_dtype(logits), device=logits.device)
        loss, nll = _softmax_stats(logits, target, epsilon, probs)
        ctx.save_for_backward(logits, target)
        ctx.probs, ctx.epsilon = probs, epsilon  # not saved_tensors: the first backward consumes it in place
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target = ctx.saved_tensors
        probs, ctx.probs = ctx.probs, None
        if probs is None:  # a second backward through a retained graph: the softmax is the gradient by now
            probs = torch.empty(logits.shape, dtype=_stats_dtype(logits), device=logits.device)
            _softmax_stats(logits, target, ctx.epsilon, probs)
        return _logits_grad(probs, target, grad_loss, grad_nll, ctx.epsilon, logits.dtype), None, None


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """The same loss of logits = hidden W^T (the pre-softmax projection of §3.4, no bias), projection included.

    Why fused: the (N,V) logits become the softmax in place and then the gradient in place, so one (N,V) buffer
    serves the whole step instead of three; and the weight gradient is computed in the layout the CPU's GEMM runs
    faster (_project_back). Under autocast the matmuls run in its dtype, in the backward too, as in nn.Linear."""

    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon: float):
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        loss, nll, ctx.probs, ctx.dtype = _projected_softmax(hidden, weight, target, epsilon)
        ctx.save_for_backward(hidden, weight, target)  # probs is not: the first backward consumes it in place
        ctx.epsilon = epsilon
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        hidden, weight, target = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        probs, ctx.probs = ctx.probs, None
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            if probs is None:  # a second backward through a retained graph: the softmax is the gradient by now
                probs = _projected_softmax(hidden, weight, target, ctx.epsilon)[2]
            grad = _logits_grad(probs, target, grad_loss, grad_nll, ctx.epsilon, ctx.dtype)  # (N,V)
            grad_hidden, grad_weight = _project_back(grad, hidden, weight)
        return grad_hidden, grad_weight, None, None


class _ProjectedRDropLoss(torch.autograd.Function):
    """R-Drop (Liang et al. 2021, eq. 3): the fused loss above on hidden (2N,D), the N real target tokens of a batch
    run twice under two dropout masks, plus per token pair the symmetric KL divergence of the two output
    distributions P1, P2, KL_sym = (KL(P1||P2) + KL(P2||P1)) / 2 = sum_v (p1 - p2)(log p1 - log p2) / 2.

    Its gradient in closed form, with d = log p1 - log p2 and <p,d> = sum_v p_v d_v:
    d KL_sym / d z1 = (p1 (d - <p1,d>) + p1 - p2) / 2 and d KL_sym / d z2 = (p2 (<p2,d> - d) + p2 - p1) / 2,
    added to the cross-entropy's in the one (2N,V) gradient buffer; the extra memory is d (N,V), kept from the
    forward, and one (N,V) buffer in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon: float):
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        both = torch.cat([target, target])  # (2N,)
        loss, nll, ctx.probs, ctx.dtype, (ctx.d, p1_d, p2_d) = _rdrop_softmax(hidden, weight, both, epsilon)
        ctx.save_for_backward(hidden, weight, both, p1_d, p2_d)  # probs and d are not: backward consumes them
        ctx.epsilon = epsilon
        return loss, nll, (p1_d - p2_d) / 2

    @staticmethod
    def backward(ctx, grad_loss, grad_nll, grad_kl):
        hidden, weight, both, p1_d, p2_d = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        probs, d, ctx.probs, ctx.d = ctx.probs, ctx.d, None, None
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            if probs is None:  # a second backward through a retained graph: they are gradients by now
                _, _, probs, _, (d, _, _) = _rdrop_softmax(hidden, weight, both, ctx.epsilon)
            p1, p2 = probs.chunk(2)
            half = (grad_kl / 2).unsqueeze(-1) if grad_kl is not None else torch.zeros_like(p1_d).unsqueeze(-1)
            grad_z2 = (p2_d.unsqueeze(-1) - d).mul_(p2).add_(p2).sub_(p1).mul_(half)  # (N,V)
            grad_z1 = d.sub_(p1_d.unsqueeze(-1)).mul_(p1).add_(p1).sub_(p2).mul_(half)  # (N,V), in d's memory
            grad = _logits_grad(probs, both, grad_loss, grad_nll, ctx.epsilon, ctx.dtype)  # (2N,V)
            g1, g2 = grad.chunk(2)
            g1.add_(grad_z1.to(grad.dtype))
            g2.add_(grad_z2.to(grad.dtype))
            grad_hidden, grad_weight = _project_back(grad, hidden, weight)
        return grad_hidden, grad_weight, None, None


def _rdrop_softmax(hidden: torch.Tensor, weight: torch.Tensor, both: torch.Tensor, epsilon: float) -> tuple:
    """_projected_softmax of the 2N rows, and (d (N,V), <p1,d> (N,), <p2,d> (N,)) of the N pairs."""
    loss, nll, probs, dtype = _projected_softmax(hidden, weight, both, epsilon)
    p1, p2 = probs.chunk(2)  # (N,V) each
    tiny = torch.finfo(probs.dtype).tiny  # a probability that underflowed to 0 adds 0 * finite, not 0 * inf
    d = p1.clamp_min(tiny).log_().sub_(p2.clamp_min(tiny).log_())  # (N,V)
    return loss, nll, probs, dtype, (d, (p1 * d).sum(-1), (p2 * d).sum(-1))  # KL(P1||P2), -KL(P2||P1)


# The weight gradient G^T hidden is the same sum in either operand order, but MKL (PyTorch's CPU GEMM) runs the two
# orders at different speeds, and which one wins depends on the CPU: on the Intel Xeon VM where the fused loss was
# written (hidden^T G)^T, 1.5x faster than G^T hidden for an 8000x128 weight on one thread; on AMD EPYC Zen 4
# G^T hidden, 33 against 43 ms for 5318x128 at N = 4000, 2 threads, +3.4-4.4% tokens/s for the whole training step,
# and the same weights bit for bit after 40 updates of either recipe. Elsewhere (GPUs) autograd's order, G^T hidden.
TRANSPOSED_WEIGHT_GRAD = cpu_info("vendor_id") == "GenuineIntel"


def _project_back(grad: torch.Tensor, hidden: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of hidden (N,D) and weight (V,D) from that of logits = hidden W^T (N,V)."""
    grad_hidden = grad @ weight  # (N,V) @ (V,D) -> (N,D)
    if TRANSPOSED_WEIGHT_GRAD and grad.device.type == "cpu":
        return grad_hidden, (hidden.t() @ grad).t()  # ((D,N) @ (N,V))^T -> (V,D)
    return grad_hidden, grad.t() @ hidden  # (V,N) @ (N,D) -> (V,D)


def _projected_softmax(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                       epsilon: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """Per-token loss and NLL (N,), softmax (N,V) in fp32 or fp64, and the logits' dtype (bf16 under autocast)."""
    logits = hidden @ weight.t()  # (N,D) @ (D,V) -> (N,V)
    stats = _stats_dtype(logits)
    probs = logits if logits.dtype == stats else torch.empty(logits.shape, dtype=stats, device=logits.device)
    loss, nll = _softmax_stats(logits, target, epsilon, probs)
    return loss, nll, probs, logits.dtype


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


# torch.compile runs this as it is: traced, its loop over blocks of rows is unrolled, a graph of thousands of ops
# for every number of target tokens N (every batch): the first batch of the En->De recipe took 118 s to compile
# instead of 22, and the benchmark's warm-up grew past 5 minutes and 8 GB
@torch.compiler.disable
def projected_label_smoothed_nll(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """label_smoothed_nll(hidden @ weight.T, target) for hidden (N,D) at real target tokens, target (N,), weight
    (V,D) the output projection, without materialising more than one (N,V) buffer. Returns the two sums."""
    loss, nll = _ProjectedSmoothedCrossEntropy.apply(hidden, weight, target, epsilon)  # (N,) each
    return loss.sum(), nll.sum()


@torch.compiler.disable  # as projected_label_smoothed_nll
def projected_rdrop_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, epsilon: float,
                         alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """R-Drop's loss for hidden (2N,D), the N real target tokens under two dropout masks (rows i and N+i are the
    same token), target (N,), weight (V,D): (sum of the smoothed loss over the 2N rows + alpha * sum of KL_sym
    over the N pairs) / 2, and the NLL sum / 2, so that both stay per-token sums over N, what the trainer divides
    by (fairseq's R-Drop criterion: the same objective, divided by 2N)."""
    loss, nll, kl = _ProjectedRDropLoss.apply(hidden, weight, target, epsilon)  # (2N,), (2N,), (N,)
    return (loss.sum() + alpha * kl.sum()) / 2, nll.sum() / 2


class TranslationLoss(nn.Module):
    """The training objective as one module, so that DDP and torch.compile wrap the model and its loss together
    (as fairseq's criterion(model, sample)): (src, tgt_in, tgt_out) -> (smoothed loss sum, NLL sum) over the real
    target tokens; the model's logits are never formed, its output projection is fused into the loss. unk_id: the
    token a target outside the model's output vocabulary counts as (model.output_vocab 'target'); rdrop_alpha > 0:
    R-Drop in training mode (projected_rdrop_loss), the plain loss in eval mode."""

    def __init__(self, model: nn.Module, epsilon: float, pad_id: int, unk_id: int, rdrop_alpha: float = 0.0):
        super().__init__()
        self.model, self.epsilon, self.pad_id, self.unk_id = model, epsilon, pad_id, unk_id
        self.rdrop_alpha = rdrop_alpha

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor,
                tgt_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = tgt_out.ne(self.pad_id)  # (B,T) real target tokens
        target = self.model.output_rows(tgt_out[keep], self.unk_id)  # (N,) rows of the output vocabulary
        if self.rdrop_alpha > 0 and self.model.training:  # the batch twice, as one (2B,...) batch: two dropout masks
            hidden = self.model.features(src.repeat(2, 1), tgt_in.repeat(2, 1), keep.repeat(2, 1))  # (2N,D)
            return projected_rdrop_loss(hidden, self.model.output_weight(), target, self.epsilon, self.rdrop_alpha)
        hidden = self.model.features(src, tgt_in, keep)  # (N,D)
        return projected_label_smoothed_nll(hidden, self.model.output_weight(), target, self.epsilon)
