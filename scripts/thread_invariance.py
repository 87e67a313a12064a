"""Does a training step give the same bits on 1 and on N torch threads on this machine?

``rollout.async_lend_threads`` changes the trainer's thread count at times that depend on the
timing; a run then stays reproducible bit for bit only where torch's kernels (oneDNN, MKL,
ATen's reductions) give the same results whatever the thread count. torch does not promise it.
This script checks it for a model on this machine: ``--steps`` synchronous GSPO steps
(rollout, π_old, two AdamW minibatches; the ``bench_vs_trl`` step) from the same seed, each
thread count in a child process, and compares a SHA-256 of all weights after every step.

    HF_HUB_OFFLINE=1 python scripts/thread_invariance.py                    # SmolLM2, ~1 min
    HF_HUB_OFFLINE=1 python scripts/thread_invariance.py --model tiny:llama --threads 1,2

Exit status 0 when every thread count gives the first one's hashes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(model: str, threads: int, steps: int, lr: float) -> list[str]:
    """The weights' hash after each of ``steps`` steps on ``threads`` threads."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_vs_trl import build_trainer

    spec = dict(model=model, prompts_per_step=2, group_size=8, max_new_tokens=32,
                minibatches=2, temperature=1.0, lr=lr, seed=0, threads=threads, steps=steps,
                arm="gspo")
    hashes = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(spec, Path(tmp))
        try:
            for _ in range(steps):
                trainer.train_step()
                trainer.step += 1
                h = hashlib.sha256()
                for p in trainer.model.parameters():
                    h.update(p.detach().contiguous().numpy().tobytes())
                hashes.append(h.hexdigest())
        finally:
            trainer.cleanup()
    return hashes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5, help="large enough to move every weight")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.model, a.child, a.steps, a.lr)))
        return 0
    runs = {}
    for t in (int(x) for x in a.threads.split(",")):
        out = subprocess.run([sys.executable, __file__, "--model", a.model, "--steps",
                              str(a.steps), "--lr", str(a.lr), "--child", str(t)],
                             check=True, capture_output=True, text=True).stdout
        runs[t] = json.loads(out.strip().splitlines()[-1])
        print(f"{t} thread(s): " + ", ".join(h[:16] for h in runs[t]), flush=True)
    first = next(iter(runs.values()))
    same = all(h == first for h in runs.values())
    print(f"{a.model}, {a.steps} steps: the weights are "
          + ("the same bit for bit on every thread count" if same
             else "NOT the same on every thread count: keep rollout.async_lend_threads off "
                  "where a run must be reproducible bit for bit"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
