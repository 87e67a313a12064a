"""The length claim of GSPO (arXiv:2507.18071 v2, Sec. 3-4): token-level importance weights
accumulate variance as responses grow, the length-normalised sequence ratio (Eq. (7)) does not.

At fixed data, for each response cap ``max_new_tokens`` L and each objective (GSPO, GRPO):

1. one rollout batch of the initial policy (the same batch for both objectives at one L);
2. the update as the trainer runs it (``objective.num_minibatches`` minibatches, one AdamW
   step each; π_old recomputed in fp32); after each step, on the WHOLE batch: the std of the
   token ratios w_it and of the sequence ratios s_i, and the clip fraction the loss saw;
3. after the last step (θ off-policy from θ_old): the policy gradient on ``--resamples``
   minibatches drawn at random from the batch, and its variance across them,
   E‖g‖² − ‖E g‖² (trace of the covariance), also relative to ‖E g‖².

Advantages are synthetic: SmolLM2-135M scores ~0 on gsm8k_mini, so real rewards give zero
advantages (no gradient); each response gets a seeded Bernoulli(1/2) reward, group-normalised
as in training. The real reward mean is recorded beside it. Everything goes through the
trainer's own phase methods (rollout, update_batch, update, old_logprobs).

    OMP_NUM_THREADS=1 python benchmarks/bench_length.py            # ~15 min, results/length/
    python benchmarks/bench_length.py --model tiny:llama --lengths 4 8 --out /tmp/x  # seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402
from gspo.config import load_config  # noqa: E402
from gspo.objectives import objective_from_config  # noqa: E402
from gspo.trainer import Trainer  # noqa: E402
from gspo.trainer.update import UpdatePlan, plan_update  # noqa: E402

OBJECTIVES = {"gspo": ("gspo", 3e-4, 4e-4), "grpo": ("grpo", 0.2, 0.27)}


def _trainer(args: argparse.Namespace, length: int, out: Path) -> Trainer:
    cfg = load_config(None, [
        f"model={args.model}", "task.name=gsm8k_mini", "reward.functions=[numeric_match]",
        f"rollout.max_new_tokens={length}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}", "rollout.temperature=1.0",
        f"objective.num_minibatches={args.minibatches}", f"optim.lr={args.lr}",
        "eval_before=false", "task.eval_size=0", "steps=1", f"output_dir={out}",
        f"run_name=len{length}", "progress=false", "tensorboard=false",
        f"num_threads={args.threads}", f"seed={args.seed}"])
    return Trainer(cfg).setup()


def _ratio_spread(t: Trainer, batch: Any) -> dict[str, float]:
    """Std of w_it over response tokens and of s_i over rows, at the current θ (no grad)."""
    cols = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "response_mask": batch.response_mask}
    logp, _, _ = t.old_logprobs(cols)
    on = batch.response_mask > 0
    log_w = torch.where(on, logp.double() - batch.old_logprobs.double(), 0.0)
    log_s = log_w.sum(-1) / on.sum(-1).clamp(min=1)
    valid = on.any(-1)
    return {"token_ratio_std": float(log_w[on].exp().std(unbiased=False)),
            "seq_ratio_std": float(log_s[valid].exp().std(unbiased=False)),
            "token_log_ratio_abs_max": float(log_w[on].abs().max())}


def _grad(t: Trainer, batch: Any, rows: torch.Tensor) -> torch.Tensor:
    """The flattened policy gradient of the objective on ``rows`` at the current θ."""
    mb = batch.rows(rows)
    t.model.train()
    t.optimizer.zero_grad(set_to_none=True)
    logp, _ = t.dist.forward(t.model, t.logprob_fn, mb.input_ids, mb.attention_mask,
                             mb.response_mask, temperature=t.cfg.rollout.temperature,
                             chunk=t.cfg.logprob_chunk)
    loss, _ = t.objective.loss(logp, mb.old_logprobs, mb.advantages, mb.response_mask)
    loss.backward()
    g = torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])
    t.optimizer.zero_grad(set_to_none=True)
    return g


def run_length(args: argparse.Namespace, length: int, out: Path) -> dict[str, Any]:
    t = _trainer(args, length, out)
    start = time.perf_counter()
    examples, roll = t.rollout()
    real, _ = t.score(examples, roll)
    gen = torch.Generator().manual_seed(args.seed * 101 + length)
    synth = torch.bernoulli(torch.full((len(roll),), 0.5), generator=gen)
    adv = t.advantages(synth, roll)
    lengths = torch.tensor([len(r) for r in roll.response_ids], dtype=torch.float64)
    initial = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    row: dict[str, Any] = {"max_new_tokens": length, "rollout_s": time.perf_counter() - start,
                           "response_len_mean": float(lengths.mean()),
                           "truncated_frac": sum(roll.truncated) / len(roll),
                           "real_reward_mean": float(real.nanmean()), "objectives": {}}
    n = len(roll)
    for name, (obj, lo, hi) in OBJECTIVES.items():
        t0 = time.perf_counter()
        t.model.load_state_dict(initial)
        t.cfg.objective.name, t.cfg.objective.eps_low, t.cfg.objective.eps_high = obj, lo, hi
        t.objective = objective_from_config(t.cfg.objective)
        t.optimizer = torch.optim.AdamW([p for p in t.model.parameters() if p.requires_grad],
                                        lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
        t.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda i: 1.0)
        order = plan_update(n, num_minibatches=args.minibatches, epochs=1,
                            generator=torch.Generator().manual_seed(args.seed))
        full = UpdatePlan(order.minibatches)  # π_old from the full pass, no first-row reuse
        batch, _ = t.update_batch(roll, adv, full)
        steps = []
        for mb in order.minibatches[0]:
            result = t.update(batch, UpdatePlan([[mb]]))
            stats = {k: float(v) for k, v in result.stats[0].items()} if result.stats else {}
            steps.append({"clip_frac_tokens": stats.get("objective/clip_frac_tokens"),
                          "clip_frac_seqs": stats.get("objective/clip_frac_seqs"),
                          **_ratio_spread(t, batch)})
        rs = torch.Generator().manual_seed(args.seed * 7 + length)
        size = max(1, n // args.minibatches)
        mean = sq = None
        for _ in range(args.resamples):
            g = _grad(t, batch, torch.randperm(n, generator=rs)[:size].sort().values)
            mean = g if mean is None else mean + g
            sq = float(g.double().square().sum()) + (0.0 if sq is None else sq)
        mean = mean / args.resamples
        var = sq / args.resamples - float(mean.double().square().sum())
        row["objectives"][name] = {
            "steps": steps, "grad_var_trace": var,
            "grad_var_relative": var / max(float(mean.double().square().sum()), 1e-30),
            "grad_mean_norm": float(mean.norm()), "seconds": time.perf_counter() - t0}
    t.cleanup()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| max_new_tokens | mean length | truncated | objective | clip frac (tokens), "
            "mean over steps | token-ratio std after last step | seq-ratio std after last "
            "step | grad variance (trace) | grad variance / ‖E g‖² |\n|" + "---|" * 9)
    lines = [head]
    for r in rows:
        for name, o in r["objectives"].items():
            clips = [s["clip_frac_tokens"] for s in o["steps"] if s["clip_frac_tokens"] is not None]
            last = o["steps"][-1]
            lines.append(f"| {r['max_new_tokens']} | {r['response_len_mean']:.1f} | "
                         f"{r['truncated_frac']:.2f} | {name} | "
                         f"{sum(clips) / max(len(clips), 1):.4f} | {last['token_ratio_std']:.3e} | "
                         f"{last['seq_ratio_std']:.3e} | {o['grad_var_trace']:.3e} | "
                         f"{o['grad_var_relative']:.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8), layout="constrained")
    xs = [r["max_new_tokens"] for r in rows]
    panels = [("token_ratio_std", "token-ratio std (whole batch, after last step)"),
              ("seq_ratio_std", "sequence-ratio std (whole batch, after last step)"),
              ("clip", "clipped-token fraction (mean over steps)"),
              ("grad_var_relative", "policy-gradient variance / ‖E g‖² (resampled minibatches)")]
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(2, 2, i + 1)
        for name in OBJECTIVES:
            if key == "clip":
                ys = [sum(s["clip_frac_tokens"] or 0 for s in r["objectives"][name]["steps"])
                      / len(r["objectives"][name]["steps"]) for r in rows]
            elif key.endswith("std"):
                ys = [r["objectives"][name]["steps"][-1][key] for r in rows]
            else:
                ys = [r["objectives"][name][key] for r in rows]
            ax.plot(xs, ys, "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("max_new_tokens")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GSPO vs GRPO against response length (SmolLM2-135M, gsm8k_mini, fixed data)")
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--resamples", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-7,
                   help="at 1e-5 one step already pushes every GSPO sequence out of its band")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "results" / "length"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, cpu = time.perf_counter(), time.process_time()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as runs:
        for length in args.lengths:  # results are rewritten after each length (partial runs)
            rows.append(run_length(args, length, Path(runs)))
            data = write(args, argv, rows, out, time.perf_counter() - start,
                         time.process_time() - cpu)
            print(f"max_new_tokens={length} done at {data['wall_s']:.0f} s", flush=True)
    return data


def write(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]],
          out: Path, wall_s: float, cpu_s: float) -> dict[str, Any]:
    data = {"command": "python benchmarks/bench_length.py " + " ".join(argv or sys.argv[1:]),
            "args": vars(args), "wall_s": wall_s, "cpu_s": cpu_s, "machine": machine(),
            "rows": rows}
    (out / "length.json").write_text(json.dumps(data, indent=2))
    (out / "length.md").write_text(
        f"# GSPO vs GRPO against response length\n\nCommand: `{data['command']}` "
        f"({wall_s / 60:.1f} min wall, {cpu_s / 60:.1f} min CPU). {args.prompts} prompts x "
        f"{args.group_size} responses, {args.minibatches} minibatches, {args.resamples} "
        f"resampled minibatches for the gradient variance; synthetic Bernoulli(1/2) "
        f"rewards (see the script).\n\n"
        + table(rows) + "\n")
    plot(rows, out / "length.png")
    return data


if __name__ == "__main__":
    main()
