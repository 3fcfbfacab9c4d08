"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): verified mode that samples.

The draft samples each of its k tokens from its own warped distribution q_i; the exact model
gives p_0..p_k for the same positions (one forward, as in greedy verification). Draft i is kept
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection m the block's last token is
drawn from norm(max(0, p_m - q_m)), and when all k are kept, from p_k (a bonus token). Whatever
q is, every emitted token is then distributed exactly as sampling from p: the output is the
exact model's sampled text, only the speed depends on the draft. Both distributions are warped
the same way (temperature, top-k, top-p: ``sampling.warped_probs``).

``speculative_step`` runs on the device with fixed shapes (one captured graph per k), reading
its randomness from uniforms the caller draws from the seeded generator, so a seed reproduces a
reply. ``speculative_reference`` is its plain twin, one position at a time.
"""

from __future__ import annotations

import torch


def speculative_step(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                     u_accept: torch.Tensor, u_final: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """p (k + 1, V) the exact model's warped probabilities, q (k, V) the draft's, draft (k,)
    the drafted tokens, u_accept (k,) and u_final (1,) uniforms in [0, 1). Returns (m, token):
    the number of drafts kept (a long scalar) and the block's last token (1,)."""
    k, vocab = q.shape
    p_x = p[:k].gather(1, draft[:, None])[:, 0]
    q_x = q.gather(1, draft[:, None])[:, 0]
    keep = u_accept * q_x < p_x  # u < p / q, without dividing by a q of 0
    m = keep.long().cumprod(dim=0).sum()
    # q has no row k: a zero row there makes the bonus (m = k) the same formula, max(0, p_k).
    q_rows = torch.cat([q, q.new_zeros(1, vocab)])
    p_m = p.index_select(0, m[None])
    residual = (p_m - q_rows.index_select(0, m[None])).clamp(min=0)
    # A rejection means p_m(x) < q_m(x), so the residual has mass; guard rounding anyway.
    dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_m)
    cdf = dist.cumsum(dim=-1)
    token = torch.searchsorted(cdf, (u_final * cdf[:, -1])[:, None], right=True)
    return m, token.clamp(max=vocab - 1)[0]


def speculative_reference(p: torch.Tensor, q: torch.Tensor, draft: list[int],
                          u_accept: list[float], u_final: float) -> tuple[int, int]:
    """The rule as written, one position at a time, in float64."""
    p, q = p.double(), q.double()

    def draw(weights: torch.Tensor) -> int:
        threshold, running = u_final * float(weights.sum()), 0.0
        for i, w in enumerate(weights.tolist()):
            running += w
            if threshold < running:
                return i
        return len(weights) - 1

    for i, x in enumerate(draft):
        ratio = float(p[i, x]) / float(q[i, x]) if float(q[i, x]) > 0 else (
            float("inf") if float(p[i, x]) > 0 else 0.0)
        if not u_accept[i] < min(1.0, ratio):
            residual = (p[i] - q[i]).clamp(min=0)
            return i, draw(residual if float(residual.sum()) > 0 else p[i])
    return len(draft), draw(p[len(draft)])
