"""Cold-start supervised stage: teach a tiny model the arithmetic task before RL.

RL learns only from groups whose rewards differ: a random tiny model never answers and a
perfect one always does. :func:`cold_start` fine-tunes ``SFTConfig.base`` with teacher forcing
on prompt -> ``"a+b=c"`` answers (loss on the response tokens only, AdamW), measures greedy
held-out accuracy before and after, and caches the model under
``cache_dir()/sft/<hash of the config>``. A run config naming ``model: sft:<tiny name>``
(e.g. ``sft:tiny_moe``) builds it on first use and reuses it afterwards: importing this module
registers the ``sft`` source in :data:`gspo.models.loading.MODEL_SOURCES`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gspo.config import ConfigError, SFTConfig, load_sft_config, to_dict
from gspo.data import ArithmeticTask, DataError, Example, format_prompt
from gspo.models.loading import (
    MODEL_CONFIGS,
    MODEL_SOURCES,
    cache_dir,
    folder_identity,
    load_model,
)
from gspo.models.logprobs import token_logprobs
from gspo.models.tokens import eos_ids
from gspo.rewards import RewardScorer
from gspo.rollout import pad_batch
from gspo.trainer.evaluate import evaluate

SFT_FORMAT = 1
"""Version of the recipe below; part of the cache key, so a changed recipe rebuilds the cache."""
_NOT_IN_KEY = ("eval_size",)  # fields that do not change the trained weights
# Fields that change the trained weights, keyed only away from the value every cache was built
# with before they were keyed (existing caches stay valid): ``num_threads`` (CPU kernels split
# their sums by thread, so another count trains other weights, apart by ~1e-5 after 30 steps).
_KEY_UNLESS = {"num_threads": 1}
# Fields no longer in SFTConfig, at the value every cache was keyed with: ``fused`` (never read;
# the recipe's AdamW was never the fused kernel), kept so that existing caches stay valid.
_KEY_OF_REMOVED = {"fused": True}
_QUESTION = re.compile(r"What is (.+)\? Answer with a number\.")


def response_text(ex: Example) -> str:
    """The supervised answer to an arithmetic problem: ``"23+5=28"``."""
    m = _QUESTION.fullmatch(ex.prompt)
    if m is None:
        raise DataError(f"sft: not an arithmetic-task prompt: {ex.prompt!r}")
    return f"{m.group(1)}={ex.answer}"


def config_hash(cfg: SFTConfig) -> str:
    """The cache key of ``cfg``'s cold start: its fields that change the trained weights and,
    for a base given as a folder, that folder's identity (:func:`folder_identity`)."""
    data = {k: v for k, v in to_dict(cfg).items()
            if k not in _NOT_IN_KEY and not (k in _KEY_UNLESS and _KEY_UNLESS[k] == v)}
    base = folder_identity(cfg.base)
    blob = json.dumps({"format": SFT_FORMAT, **_KEY_OF_REMOVED, **data,
                       **({"base_folder": base} if base else {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sft_dir(cfg: SFTConfig) -> Path:
    """Where the cold start of ``cfg`` is cached."""
    return cache_dir() / "sft" / config_hash(cfg)


def sft_batch(tokenizer: Any, examples: list[Example], cfg: SFTConfig,
              eos_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt + answer + EOS; ``response_mask`` marks the answer and the EOS."""
    prompts = [format_prompt(tokenizer, ex.prompt, chat_template=cfg.chat_template,
                             system_prompt=cfg.system_prompt) for ex in examples]
    answers = [tokenizer(response_text(ex), add_special_tokens=False)["input_ids"] + [eos_id]
               for ex in examples]
    return pad_batch(prompts, answers, tokenizer.pad_token_id)


def sft_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens (teacher forcing)."""
    mask = batch["response_mask"]
    logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], mask)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)


def held_out_accuracy(model: Any, tokenizer: Any, task: ArithmeticTask, cfg: SFTConfig) -> float:
    """Greedy accuracy (numeric_match) on the task's held-out problems."""
    if not task.eval_examples:
        return math.nan
    longest = max(len(tokenizer(response_text(ex))["input_ids"]) for ex in task.eval_examples)
    res = evaluate(model, tokenizer, task.eval_examples,
                   RewardScorer.from_specs(["numeric_match"], []),
                   chat_template=cfg.chat_template, system_prompt=cfg.system_prompt,
                   max_new_tokens=longest + 2, eos=eos_ids(model, tokenizer),
                   pad_id=tokenizer.pad_token_id)
    return res["accuracy"]


def _schedule(cfg: SFTConfig) -> Callable[[int], float]:
    def f(i: int) -> float:
        if i < cfg.warmup_steps:
            return (i + 1) / cfg.warmup_steps
        frac = min(1.0, (i - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def train_sft(cfg: SFTConfig, log: Callable[[str], None] = print
              ) -> tuple[Any, Any, dict[str, Any]]:
    """Fine-tune ``cfg.base``; return ``(model, tokenizer, info)`` (info: accuracies, times)."""
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:  # a cold start built inside a run's model loading must not change the run's threads
        return _train(cfg, log)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: SFTConfig, log: Callable[[str], None]) -> tuple[Any, Any, dict[str, Any]]:
    start = time.perf_counter()
    model, tokenizer = load_model(cfg.base, seed=cfg.seed)
    task = ArithmeticTask(cfg.levels, [], cfg.operations, [], cfg.eval_size, cfg.seed)
    # the tokenizer's EOS ends a chat turn (Llama 3: <|eot_id|>, not the generation config's
    # lower <|end_of_text|>); a tokenizer without one: the model's first
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else \
        eos_ids(model, tokenizer)[0]
    before = held_out_accuracy(model, tokenizer, task, cfg)
    log(f"sft: {cfg.base}, levels {cfg.levels}: held-out accuracy before {before:.1%}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))
    model.train()
    losses: list[float] = []
    for step in range(cfg.steps):
        loss = sft_loss(model, sft_batch(tokenizer, task.sample(cfg.batch_size), cfg, eos))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, cfg.steps // 8) == 0 or step + 1 == cfg.steps:
            recent = losses[-20:]
            log(f"sft: step {step + 1}/{cfg.steps} loss {sum(recent) / len(recent):.4f}")
    model.eval()
    after = held_out_accuracy(model, tokenizer, task, cfg)
    info = {"accuracy_before": before, "accuracy_after": after,
            "final_loss": losses[-1] if losses else math.nan,
            "n_eval": len(task.eval_examples), "train_time_s": time.perf_counter() - start}
    log(f"sft: held-out accuracy {before:.1%} -> {after:.1%} "
        f"({len(task.eval_examples)} problems, greedy) in {info['train_time_s']:.0f} s")
    return model, tokenizer, info


def _save_atomically(model: Any, tokenizer: Any, meta: dict[str, Any], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    old = None
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "sft.json").write_text(json.dumps(meta, indent=2))
        if target.exists():  # a forced rebuild: move the old copy aside first
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=".old-"))
            os.replace(target, old / "model")
        os.replace(tmp, target)  # atomic: readers see the old folder, or the complete new one
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent builder that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def cold_start(cfg: SFTConfig | None = None, *, force: bool = False,
               log: Callable[[str], None] = print) -> Path:
    """The cached cold-start model folder of ``cfg``; trained (and cached) when missing."""
    cfg = cfg if cfg is not None else SFTConfig()
    target = sft_dir(cfg)
    if not force and (target / "config.json").is_file():
        return target
    log(f"sft: building the cold start into {target}")
    model, tokenizer, info = train_sft(cfg, log)
    _save_atomically(model, tokenizer, {"config": to_dict(cfg), "format": SFT_FORMAT, **info},
                     target)
    return target


def read_info(folder: Path) -> dict[str, Any]:
    """The ``sft.json`` written next to a cached cold start (config and accuracies)."""
    return json.loads((Path(folder) / "sft.json").read_text())


def source_config(name: str) -> SFTConfig:
    """The :class:`SFTConfig` of ``model: sft:<name>[?k=v&...]`` (bad options: ConfigError)."""
    base, _, query = name.partition("?")
    if not query:
        return SFTConfig(base=f"tiny:{base}")
    overrides = [kv for kv in query.split("&") if kv]
    if any(kv.partition("=")[0].strip() == "base" for kv in overrides):
        raise ConfigError(f"sft:{name}: the base is the name before '?'; drop base=")
    return load_sft_config(None, [f"base=tiny:{base}", *overrides])


@MODEL_SOURCES.register("sft")
def resolve_sft(name: str) -> Path:
    """``model: sft:<name>``: the default cold start (:class:`SFTConfig`) of ``tiny:<name>``;
    ``sft:<name>?steps=1600&lr=0.003`` changes :class:`SFTConfig` fields (cached apart, by
    the whole config's hash)."""
    return cold_start(source_config(name))


@MODEL_CONFIGS.register("sft")
def sft_model_config(name: str) -> Any:
    """The config of ``model: sft:<name>[?...]``: its base ``tiny:<name>``'s (a cold start
    changes the weights, not the architecture), without training or reading the cache; the
    options after ``?`` are checked as :func:`resolve_sft` reads them (``gspo validate``)."""
    from gspo.models.tiny import byte_tokenizer, tiny_config

    source_config(name)
    return tiny_config(name.partition("?")[0], vocab_size=len(byte_tokenizer()))
