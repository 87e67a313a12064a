"""gspo's ``gspo_loss`` vs TRL's GSPO loss on identical per-token log-prob tensors.

TRL's side is TRL's own code: ``trl.trainer.grpo_trainer.GRPOTrainer._compute_loss``
(trl 1.16.0), called unbound on a stub trainer whose log-prob function returns the given
tensors, with ``importance_sampling_level="sequence"``, ``loss_type="grpo"``, β = 0,
ε = 3e-4 / 4e-4 and no gradient accumulation. For every case both losses and their
gradients with respect to the per-token log-probs are compared.

Aggregation. TRL's ``loss_type="grpo"`` with sequence-level importance sampling computes one
clipped term per sequence, broadcasts it over the sequence's tokens, takes each sequence's
token mean (which returns the term itself) and then the mean over the rows of the micro-batch,
i.e. (1/G) Σ_i term_i, the paper's Eq. (5), the same as gspo's default ``aggregation="sequence"``.
Where they differ: (a) a row with no response tokens counts in TRL's mean as a zero term
(the divisor is all rows) while gspo averages over rows that have tokens; (b) gspo clamps the
sequence log-ratio to [-20, 20] before exp (overflow guard), TRL does not.

    python -m benchmarks.bench_objective
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.common import machine, write_result

EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def _stub_trainer(logps: torch.Tensor) -> Any:
    """The attributes ``GRPOTrainer._compute_loss`` reads, for a single process, no extras."""
    identity = SimpleNamespace(reduce=lambda x, reduction="sum": x, gather=lambda x: x,
                               gather_for_metrics=lambda x: x, num_processes=1)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="sequence", beta=0.0, loss_type="grpo",
        epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, args=SimpleNamespace(delta=None),
        use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), accelerator=identity)


def trl_loss(logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._compute_loss on [B, C] completion log-probs."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    b, c = logps.shape
    inputs = {"prompt_ids": torch.zeros((b, 1), dtype=torch.long),
              "prompt_mask": torch.ones((b, 1), dtype=torch.long),
              "completion_ids": torch.zeros((b, c), dtype=torch.long),
              "completion_mask": mask.long(), "advantages": adv, "old_per_token_logps": old}
    return GRPOTrainer._compute_loss(_stub_trainer(logps), None, inputs)


def gspo_side(logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    from gspo.objectives import OBJECTIVES

    loss, _ = OBJECTIVES["gspo"](logps, old, adv, mask.float(), eps_low=EPS_LOW,
                                 eps_high=EPS_HIGH)
    return loss


def make_case(seed: int, *, rows: int = 16, cols: int = 32, spread: float = 1e-3,
              empty_rows: int = 0) -> tuple[torch.Tensor, ...]:
    """Random log-probs, π_old near π_θ (some sequences beyond ε), random lengths/advantages."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand((rows, cols), generator=g, dtype=torch.float32) * 5
    old = logps + spread * torch.randn((rows, cols), generator=g)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[:empty_rows] = 0
    mask = torch.arange(cols)[None] < lengths[:, None]
    adv = torch.randn(rows, generator=g)
    return logps, old, adv, mask


def compare(case: tuple[torch.Tensor, ...]) -> dict[str, float]:
    logps, old, adv, mask = case
    out = {}
    grads = []
    for name, fn in (("gspo", gspo_side), ("trl", trl_loss)):
        x = logps.clone().requires_grad_(True)
        loss = fn(x, old, adv, mask)
        loss.backward()
        out[name] = float(loss.detach())
        grads.append(x.grad * mask)
    out["abs_diff"] = abs(out["gspo"] - out["trl"])
    out["grad_max_abs_diff"] = float((grads[0] - grads[1]).abs().max())
    # TRL divides by all rows, gspo by rows with tokens: rescaled, the two must agree
    share = float(mask.any(-1).float().mean())
    out["abs_diff_after_rescaling"] = abs(out["gspo"] * share - out["trl"])
    s = torch.exp(((logps - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    clipped = ((s > 1 + EPS_HIGH) & (adv > 0)) | ((s < 1 - EPS_LOW) & (adv < 0))
    out["clipped_seq_frac"] = float(clipped[mask.any(-1)].float().mean())
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    import trl

    suites = {
        "all rows non-empty": [compare(make_case(s)) for s in range(a.cases)],
        "ratios far outside ε (clipping active)": [
            compare(make_case(100 + s, spread=3e-2)) for s in range(a.cases)],
        "4 of 16 rows empty": [compare(make_case(200 + s, empty_rows=4)) for s in range(a.cases)],
    }
    summary = {name: {"max_abs_diff": max(r["abs_diff"] for r in rs),
                      "max_grad_abs_diff": max(r["grad_max_abs_diff"] for r in rs),
                      "max_abs_diff_after_rescaling": max(r["abs_diff_after_rescaling"]
                                                          for r in rs),
                      "mean_clipped_seq_frac": sum(r["clipped_seq_frac"] for r in rs) / len(rs),
                      "equal_to_1e-5": all(r["abs_diff"] <= 1e-5 and r["grad_max_abs_diff"] <= 1e-5
                                           for r in rs)}
               for name, rs in suites.items()}
    data = {"trl": trl.__version__, "machine": machine(), "summary": summary, "cases": suites}
    header = (f"| inputs ({a.cases} random cases each, 16 rows × 32 tokens) | clipped seqs | "
              "max abs loss diff | max abs grad diff | equal to 1e-5 | loss diff after "
              "rescaling by valid-row share |\n|---|---|---|---|---|---|")
    rows = [f"| {name} | {100 * s['mean_clipped_seq_frac']:.0f}% | {s['max_abs_diff']:.2e} | "
            f"{s['max_grad_abs_diff']:.2e} | {'yes' if s['equal_to_1e-5'] else 'no'} | "
            f"{s['max_abs_diff_after_rescaling']:.2e} |" for name, s in summary.items()]
    write_result("objective_equivalence", data, header, rows, a.out)
    print("\n".join([header, *rows]))
    return data


if __name__ == "__main__":
    main()
