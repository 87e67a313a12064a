"""The β·KL(π_θ‖π_ref) term is aggregated like the policy term, for every aggregation; GSPO-token
keeps GSPO's value and gradient beyond the overflow clamp."""

from __future__ import annotations

import pytest
import torch

from gspo.objectives import OBJECTIVES

F64 = torch.float64
TOKEN_LOSSES = {
    "grpo": {"eps_low": 0.2, "eps_high": 0.2},
    "sapo": {},
    "dppo_tv": {},
    "dppo_kl": {},
    "clip_cov": {"eps_low": 0.2, "eps_high": 0.2},
    "kl_cov": {},
}


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=F64)
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.6],
                                   [0.6, 0.7, 1.0, 1.0, 1.0],
                                   [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=F64))
    ref = logp - torch.tensor([0.5, -0.3, 0.2, 0.1, -0.4], dtype=F64)
    return logp, ref, mask


def _reference(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, aggregation: str,
               c: float) -> torch.Tensor:
    """β = 1 and no policy term: the KL term alone, reduced as the policy term would be."""
    d = ref - logp
    k3 = (d.exp() - d - 1) * mask
    n, valid = mask.sum(-1), mask.sum(-1) > 0
    if aggregation == "token":
        return k3.sum() / n.sum()
    per_row = k3.sum(-1) / c if aggregation == "constant" else k3.sum(-1) / n.clamp(min=1)
    return per_row[valid].mean()


@pytest.mark.parametrize("name", sorted(TOKEN_LOSSES))
@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_kl_term_is_aggregated_like_the_policy_term(name, aggregation):
    logp, ref, mask = _batch()
    c = 8.0 if aggregation == "constant" else 0.0
    x = logp.clone().requires_grad_(True)
    # π_θ = π_old and Â = 0: every policy term (and KL-Cov's |log w| penalty) is 0
    loss, stats = OBJECTIVES[name](x, logp, torch.zeros(3, dtype=F64), mask, beta=1.0,
                                   ref_logprobs=ref, aggregation=aggregation, norm_constant=c,
                                   **TOKEN_LOSSES[name])
    (grad,) = torch.autograd.grad(loss, x)
    y = logp.clone().requires_grad_(True)
    want = _reference(y, ref, mask, aggregation, c)
    (want_grad,) = torch.autograd.grad(want, y)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    torch.testing.assert_close(stats["objective/kl_ref"], want.float())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gspo_token_equals_gspo_beyond_the_overflow_clamp(sign):
    """Eq. (13)-(14): with Â_it = Â_i GSPO-token has GSPO's value and gradient, also for rows
    whose mean log-ratio lies beyond the [-20, 20] overflow clamp (zero gradient there)."""
    from gspo.objectives import gspo_loss, gspo_token_loss

    mean_log_ratio = torch.tensor([-25.0, -0.3, 0.01, 19.0, 25.0], dtype=F64)
    old = torch.full((5, 3), -30.0, dtype=F64)
    offsets = torch.tensor([0.2, -0.1, -0.1], dtype=F64)
    lp = old + mean_log_ratio[:, None] + offsets
    adv = sign * torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0], dtype=F64)
    mask = torch.ones(5, 3, dtype=F64)
    out = []
    for fn in (gspo_loss, gspo_token_loss):
        x = lp.clone().requires_grad_(True)
        loss, _ = fn(x, old, adv, mask, eps_low=0.2, eps_high=0.2)
        out.append((loss, torch.autograd.grad(loss, x)[0]))
    torch.testing.assert_close(out[1][0], out[0][0])
    torch.testing.assert_close(out[1][1], out[0][1])
