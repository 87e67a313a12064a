"""Pinned loss values, gradients and stats of every registered objective on one fixed input.

The values were computed once (on the code before objectives were bound through
:mod:`gspo.objectives.spec`) and guard against any silent change of the arithmetic.
Reproduce (prints the table below) with:

    PYTHONPATH=$PWD python tests/objectives/test_pinned_values.py
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gspo.objectives import OBJECTIVES, Objective, loss_options

F64 = torch.float64
SEED = 20240611
KW = dict(eps_low=0.2, eps_high=0.28, beta=0.05)
STATS = ("policy_loss", "kl_ref", "clip_frac_tokens", "clip_frac_seqs", "seq_ratio_max",
         "approx_kl", "token_ratio_mean")


def pinned_case() -> tuple[torch.Tensor, ...]:
    """6 rows of lengths 8, 5, 3, 0 (empty), 7, 1; padding holds garbage."""
    g = torch.Generator().manual_seed(SEED)
    B, T = 6, 8
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.1
    lp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    lengths = torch.tensor([8, 5, 3, 0, 7, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    pad = mask == 0
    return (lp.masked_fill(pad, 50.0), old.masked_fill(pad, -50.0), adv, mask,
            ref.masked_fill(pad, 9.0))


def measure(name: str, options: dict[str, str]) -> dict[str, float]:
    """Loss, Σ|∂loss/∂logprobs| and a few stats of ``name`` on :func:`pinned_case`."""
    lp, old, adv, mask, ref = pinned_case()
    lp.requires_grad_(True)
    takes = loss_options(name)  # losses without a ratio clip take no eps_low/eps_high
    objective = Objective(name, {**{k: v for k, v in KW.items() if k in takes}, **options})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gspo aggregation='token' warns
        loss, stats = objective.loss(lp, old, adv, mask, ref_logprobs=ref)
    (grad,) = torch.autograd.grad(loss, lp)
    out = {"loss": loss.item(), "grad_abs_sum": grad.abs().sum().item()}
    return out | {k: stats[f"objective/{k}"].item() for k in STATS}


# the same for every objective (they do not depend on the loss)
_COMMON = {"kl_ref": 0.057128407061100006, "seq_ratio_max": 1.1426197290420532,
           "approx_kl": 0.024349074810743332, "token_ratio_mean": 1.0147725343704224}
PINNED: dict[tuple[str, str], dict[str, float]] = {
    ("cispo", ""): {"loss": -0.6001784778806423, "grad_abs_sum": 1.3058656828497304,
                    "policy_loss": -0.6030349135398865, "clip_frac_tokens": 0.3333333432674408,
                    "clip_frac_seqs": 0.800000011920929, **_COMMON},
    ("gmpo", ""): {"loss": 0.6060664496383515, "grad_abs_sum": 1.0738574593696102,
                   "policy_loss": 0.6032100319862366, "clip_frac_tokens": 0.125,
                   "clip_frac_seqs": 0.4000000059604645, **_COMMON},
    ("grpo", ""): {"loss": 0.6094960151892465, "grad_abs_sum": 1.1653510949625456,
                   "policy_loss": 0.6066396236419678, "clip_frac_tokens": 0.0833333358168602,
                   "clip_frac_seqs": 0.4000000059604645, **_COMMON},
    ("gspo", ""): {"loss": 0.5863007539603301, "grad_abs_sum": 1.1734330189822544,
                   "policy_loss": 0.583444356918335, "clip_frac_tokens": 0.0416666679084301,
                   "clip_frac_seqs": 0.20000000298023224, **_COMMON},
    ("gspo", "token"): {"loss": 0.6232890667043123, "grad_abs_sum": 1.6201165680537737,
                        "policy_loss": 0.6205414533615112, "clip_frac_tokens": 0.0416666679084301,
                        "clip_frac_seqs": 0.20000000298023224,
                        **_COMMON, "kl_ref": 0.054952312260866165},
    ("gspo_token", ""): {"loss": 0.58630075396033, "grad_abs_sum": 1.1734330189822542,
                         "policy_loss": 0.583444356918335, "clip_frac_tokens": 0.0416666679084301,
                         "clip_frac_seqs": 0.20000000298023224, **_COMMON},
    # the family of gspo.objectives.family, pinned on the code that added it
    ("clip_cov", ""): {**_COMMON,
        "loss": 0.6094960151892465, "grad_abs_sum": 1.1236901032902673,
        "policy_loss": 0.6066396236419678, "clip_frac_tokens": 0.0833333358168602,
        "clip_frac_seqs": 0.4000000059604645},
    ("dppo_kl", ""): {**_COMMON,
        "loss": 0.5932062451756418, "grad_abs_sum": 1.2995894742134175,
        "policy_loss": 0.5903498530387878, "clip_frac_tokens": 0.0, "clip_frac_seqs": 0.0},
    ("dppo_tv", ""): {**_COMMON,
        "loss": 0.5932062451756418, "grad_abs_sum": 1.2995894742134175,
        "policy_loss": 0.5903498530387878, "clip_frac_tokens": 0.0, "clip_frac_seqs": 0.0},
    ("gpg", ""): {**_COMMON,
        "loss": -0.4817379261247419, "grad_abs_sum": 1.6412970436729355,
        "policy_loss": -0.48448553681373596, "kl_ref": 0.054952312260866165,
        "clip_frac_tokens": 0.0, "clip_frac_seqs": 0.0},
    ("kl_cov", ""): {**_COMMON,
        "loss": 0.5972186292311683, "grad_abs_sum": 1.3245894742134177,
        "policy_loss": 0.594362199306488, "clip_frac_tokens": 0.0, "clip_frac_seqs": 0.0},
    ("luspo", ""): {**_COMMON,
        "loss": 2.9814553854680628, "grad_abs_sum": 7.7622164672259055,
        "policy_loss": 2.9785990715026855, "clip_frac_tokens": 0.0416666679084301,
        "clip_frac_seqs": 0.20000000298023224},
    ("sapo", ""): {**_COMMON,
        "loss": 1.066490993888024, "grad_abs_sum": 1.2814728722911752,
        "policy_loss": 1.0636345148086548, "clip_frac_tokens": 0.0, "clip_frac_seqs": 0.0},
}


def _options(aggregation: str) -> dict[str, str]:
    return {"aggregation": aggregation} if aggregation else {}


def test_every_registered_objective_is_pinned():
    assert {name for name, _ in PINNED} == set(OBJECTIVES)


@pytest.mark.parametrize(("name", "aggregation"), sorted(PINNED))
def test_pinned_values(name, aggregation):
    got = measure(name, _options(aggregation))
    for key, value in PINNED[name, aggregation].items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


if __name__ == "__main__":
    for name, aggregation in sorted(PINNED) + [(n, "") for n in OBJECTIVES
                                                 if (n, "") not in PINNED]:
        print((name, aggregation), measure(name, _options(aggregation)))
