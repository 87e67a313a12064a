"""Multi-turn rollouts: the policy's turns with environment observations between them.

``rollout.max_turns = K > 1`` with ``rollout.env`` (:mod:`gspo.rollout.envs`): every row
samples a turn, its environment reads it and either ends the episode or answers with an
observation, which is tokenised as a chat turn (:class:`ObservationFormat`) and appended to
the row's token ids; the policy then samples its next turn on exactly those ids, up to K
policy turns. The environment is not called on the K-th turn, so a transcript always ends
with a policy turn.

The row's ``response_ids`` are the whole transcript after the prompt (turns and observations,
in order), so the trainer's π_old and π_θ passes run over exactly the token ids the sampler
conditioned on (no re-tokenisation of decoded text). ``Rollout.model_mask`` is False on the
observation tokens and ``logprobs`` 0 there: ``pad_batch`` turns the mask into the
``response_mask`` every loss, log-prob pass and length normalisation reads, so for GSPO
(arXiv:2507.18071 v2, Eq. (7)) |y_i| counts the policy's tokens only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from gspo.config import ConfigError, RolloutConfig, TaskConfig
from gspo.data.prompts import format_prompt
from gspo.rollout.batch import Rollout
from gspo.rollout.envs import Env, resolve_env
from gspo.rollout.sampler import SamplingParams, generate

# (contexts, group_size, seeds) -> one sampled turn per context and group member
SampleFn = Callable[[list[list[int]], int, list[int]], Rollout]

_MARK_A, _MARK_O = "\u2063A7\u2063", "\u2063O7\u2063"  # placeholders found in the rendering
_ANCHOR = "a"  # text an observation is tokenised behind (ObservationFormat._continuing)


class ObservationFormat:
    """Token ids of an observation turn, as the chat template renders a message of ``role``
    after an assistant turn (the text between the assistant's content and the next assistant
    turn's content); ``chat_template=False``: the observation on its own lines."""

    def __init__(self, tokenizer: Any, *, chat_template: bool, role: str = "user") -> None:
        self.tokenizer = tokenizer
        self.before, self.after = "\n", "\n"
        if chat_template and getattr(tokenizer, "chat_template", None):
            msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _MARK_A},
                    {"role": role, "content": _MARK_O}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            a, o = text.find(_MARK_A), text.find(_MARK_O)
            if a < 0 or o < a:
                raise ValueError(f"the chat template does not render a '{role}' turn after an "
                                 "assistant turn; set task.chat_template=false")
            self.before, self.after = text[a + len(_MARK_A):o], text[o + len(_MARK_O):]

    def tokens(self, observation: str, last_token: int | None) -> list[int]:
        """The observation turn's ids after a policy turn that ended with ``last_token``; the
        template's end-of-turn token is left out when the policy already sampled it, with any
        text the template puts before it (Llama 2's ``" </s>"``).

        The text is tokenised as it continues the turn, not as the start of a string:
        SentencePiece tokenizers (a ``Prepend("▁")`` normaliser or a ``Metaspace``
        pre-tokenizer) would otherwise open every observation with a space token the
        rendering of the whole conversation does not have."""
        text = self.before + observation + self.after
        if last_token is not None and last_token in self._special:
            end = self.tokenizer.convert_ids_to_tokens(last_token)
            k = self.before.find(end) if end else -1
            if k >= 0 and not self.before[:k].strip():  # only whitespace before it
                text = text[k:]  # starts with the policy's end token (dropped below)
        ids = self._continuing(text)
        return ids[1:] if ids and last_token is not None and ids[0] == last_token else ids

    @property
    def _special(self) -> set[int]:
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return set(self.tokenizer.all_special_ids) | {
            i for i, t in added.items() if getattr(t, "special", False)}

    def _continuing(self, text: str) -> list[int]:
        """Ids of ``text`` after other text: tokenised behind an anchor whose ids are then
        dropped (as a plain string where the anchor merges with ``text``)."""
        def ids(s: str) -> list[int]:
            return self.tokenizer(s, add_special_tokens=False)["input_ids"]
        anchor = ids(_ANCHOR)
        both = ids(_ANCHOR + text)
        return both[len(anchor):] if both[:len(anchor)] == anchor else ids(text)


def make_envs(factory: Callable[[], Env], examples: list[Any], group_size: int
              ) -> tuple[list[Env], list[str | None]]:
    """One environment per row (rows of a group contiguous), reset with its example, and what
    each ``reset`` returned: the row's initial observation, or None."""
    envs, shown = [], []
    for ex in examples:
        for _ in range(group_size):
            env = factory()
            shown.append(env.reset(ex.prompt, **{**ex.columns, "answer": ex.answer}))
            envs.append(env)
    return envs, shown


def _turn_seed(seed: int, member: int, turn: int) -> int:
    """Seed of a row's later turn: a function of its prompt's seed, its place in the group and
    the turn (not of which other rows are still running)."""
    return ((seed * 1_000_003 + turn) * 65_537 + member) % (1 << 62)


def multi_turn(sample: SampleFn, prompts: list[list[int]], envs: list[Env], *,
               group_size: int, seeds: list[int], max_turns: int, fmt: ObservationFormat,
               decode: Callable[[list[int]], str]) -> Rollout:
    """``group_size`` episodes per prompt of at most ``max_turns`` policy turns each.

    ``sample`` draws one turn for a batch of contexts (an engine's ``generate``); ``envs[i]``
    is row ``i``'s environment (:func:`make_envs`, already reset); ``decode`` turns a policy
    turn's ids into the text the environment reads. ``truncated[i]``: row ``i``'s last turn
    hit the token cap.
    """
    roll = sample(prompts, group_size, seeds)
    n = len(roll)
    resp = [list(r) for r in roll.response_ids]
    lps = [[lp] for lp in roll.logprobs]
    mask = [[True] * len(r) for r in resp]
    last, truncated, turns = [list(r) for r in resp], list(roll.truncated), [1] * n
    active = list(range(n))
    for turn in range(2, max_turns + 1):
        cont = []
        for i in active:
            step = envs[i].step(decode(last[i]))
            if step.done or step.observation is None:
                continue
            obs = fmt.tokens(step.observation, last[i][-1] if last[i] else None)
            resp[i] += obs
            mask[i] += [False] * len(obs)
            lps[i].append(torch.zeros(len(obs), dtype=torch.float32))
            cont.append(i)
        if not cont:
            break
        sub = sample([roll.prompt_ids[i] + resp[i] for i in cont], 1,
                     [_turn_seed(seeds[i // group_size], i % group_size, turn) for i in cont])
        for j, i in enumerate(cont):
            resp[i] += sub.response_ids[j]
            mask[i] += [True] * len(sub.response_ids[j])
            lps[i].append(sub.logprobs[j])
            last[i], truncated[i], turns[i] = list(sub.response_ids[j]), sub.truncated[j], turn
        active = cont
    extras = {"rollout/turns_mean": sum(turns) / n, **episode_metrics(mask, turns=False)}
    return Rollout(roll.prompt_ids, resp, [torch.cat(p) for p in lps], truncated, group_size,
                   extras=extras, model_mask=mask)


def episode_metrics(mask: list[list[bool]], *, turns: bool = True) -> dict[str, float]:
    """Means over rows of a multi-turn batch's ``model_mask``: the policy's tokens, the
    observations' tokens and (``turns``) the policy's turns, counted as runs of its tokens (an
    observation always has tokens in the chat template's rendering; one of zero tokens would
    join two turns into one run)."""
    n = max(len(mask), 1)
    model = [sum(m) for m in mask]
    out = {"rollout/model_tokens_mean": sum(model) / n,
           "rollout/observation_tokens_mean": sum(len(m) - k for m, k in zip(mask, model)) / n}
    if turns:
        runs = [sum(1 for i, x in enumerate(m) if x and (i == 0 or not m[i - 1])) for m in mask]
        out["rollout/turns_mean"] = sum(runs) / n
    return out


def greedy_sampler(model: Any, *, max_new_tokens: int, eos: list[int], pad_id: int,
                   fast_decode: bool = True, decode_matmul: str = "auto") -> SampleFn:
    """A :data:`SampleFn` of greedy turns (evaluation); seeds are not used."""
    def sample(contexts: list[list[int]], group_size: int, seeds: list[int]) -> Rollout:
        return generate(model, contexts, group_size=group_size,
                        params=SamplingParams(max_new_tokens), eos=eos, pad_id=pad_id,
                        greedy=True, fast_decode=fast_decode, decode_matmul=decode_matmul)
    return sample


def engine_sampler(engine: Any, params: SamplingParams) -> SampleFn:
    """A :data:`SampleFn` sampling through a rollout engine's ``generate``."""
    def sample(contexts: list[list[int]], group_size: int, seeds: list[int]) -> Rollout:
        return engine.generate(contexts, group_size=group_size, params=params, seeds=seeds)
    return sample


class TurnLoop:
    """What the trainer holds for ``rollout.max_turns > 1``: the environment factory, the
    observation format and the turn cap; :meth:`run` is one batch of episodes.

    An environment whose ``reset`` returns text (an initial observation: OpenEnv's ``reset``
    observation, a game's board) has it shown on the first turn: the prompt is formatted
    again (``chat_template``, ``system_prompt``, as the task formats its prompts) with the
    observation after the dataset prompt in the user message. Reward functions still get the
    dataset prompt.

    ``context_limit`` (the model's ``max_position_embeddings``): a transcript that grows past
    it (the prompt, every turn and every observation) is warned of once; nothing truncates
    it, and a RoPE model samples and is trained there, out of its trained range."""

    def __init__(self, factory: Callable[[], Env], tokenizer: Any, *, max_turns: int,
                 chat_template: bool, system_prompt: str = "",
                 context_limit: int | None = None) -> None:
        self.factory, self.tokenizer, self.max_turns = factory, tokenizer, max_turns
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.fmt = ObservationFormat(tokenizer, chat_template=chat_template)
        self.context_limit, self._warned_context = context_limit, False

    @classmethod
    def from_config(cls, rollout: RolloutConfig, task: TaskConfig, tokenizer: Any, *,
                    context_limit: int | None = None) -> TurnLoop | None:
        """None for single-turn rollouts (``rollout.max_turns = 1``)."""
        if rollout.max_turns == 1:
            return None
        try:
            factory = resolve_env(rollout.env)
        except (KeyError, ValueError) as e:  # an unknown name lists the registered ones
            raise ConfigError(f"rollout.env: {e}") from e
        return cls(factory, tokenizer, max_turns=rollout.max_turns,
                   chat_template=task.chat_template, system_prompt=task.system_prompt,
                   context_limit=context_limit)

    def run(self, sample: SampleFn, examples: list[Any], prompts: list[list[int]],
            seeds: list[int], group_size: int) -> Rollout:
        envs, shown = make_envs(self.factory, examples, group_size)
        prompts = [self._with_observation(ex, ids, shown[p * group_size:(p + 1) * group_size])
                   for p, (ex, ids) in enumerate(zip(examples, prompts))]
        roll = multi_turn(sample, prompts, envs, group_size=group_size, seeds=seeds,
                          max_turns=self.max_turns, fmt=self.fmt, decode=self._decode)
        self._warn_past_context(roll)
        return roll

    def _warn_past_context(self, roll: Rollout) -> None:
        """Warn once when a transcript ran past ``context_limit`` positions."""
        limit = self.context_limit
        if limit is None or self._warned_context:
            return
        longest = max((len(p) + len(r) for p, r in zip(roll.prompt_ids, roll.response_ids)),
                      default=0)
        if longest <= limit:
            return
        self._warned_context = True
        warnings.warn(f"rollout: a multi-turn transcript (prompt, turns and observations) is "
                      f"{longest} tokens, past the model's max_position_embeddings={limit}: "
                      "later turns are sampled and trained on beyond the positions the model "
                      "was trained on (lower rollout.max_turns, rollout.max_new_tokens or the "
                      "observations' length)", stacklevel=3)

    def _with_observation(self, example: Any, ids: list[int],
                          shown: list[str | None]) -> list[int]:
        """The prompt's ids, formatted again with its group's initial observation, if any."""
        if not any(shown):
            return ids
        if len(set(shown)) > 1:  # the group's rows share one prompt (and its KV cache)
            raise ValueError("rollout.env: the rows of one group reset to different initial "
                             "observations; a group must start from one state (make reset "
                             "a function of the prompt: OpenEnvAdapter seeds it with one)")
        text = f"{example.prompt}\n\n{shown[0]}" if example.prompt else str(shown[0])
        return format_prompt(self.tokenizer, text, chat_template=self.chat_template,
                             system_prompt=self.system_prompt)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
