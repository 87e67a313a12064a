"""The trainer's side of ``rollout.async_steps = k``: a k-step off-policy rollout pipeline.

The batch of step ``t`` (0-based) is sampled from policy version ``v(t) = max(0, t - k)``,
the weights after ``v(t)`` updates: a fixed function of ``t``, so the run is deterministic
whatever the timing, staleness ``t - v(t)`` never exceeds k, and k = 0 would be the
synchronous loop. (One exception: a finished run resumed with more steps never drew the
batches of its last k steps, so those come from the version it resumes with, less stale.)
At step ``t`` the trainer publishes version ``t`` (the weights it holds then), asks the engine
process (:class:`gspo.rollout.async_engine.AsyncEngine`) for every batch up to ``t + k``
(their versions are all published by then), takes batch ``t`` and trains on it while the
engine samples ``t + 1 … t + k``.

A guard rollback (:mod:`gspo.trainer.guard`) after step ``t`` puts back the weights of an
earlier step ``g``. Since version ``t + 1`` is only published when step ``t + 1`` starts, the
weights it discarded are never published; :meth:`AsyncRollout.rolled_back` publishes the
restored ones as version ``t + 1`` at once and samples the batches in flight from versions
newer than ``g`` again from them, with the same prompts and seeds.

Prompts are drawn by the trainer, in step order, when a batch is asked for; so at a
checkpoint after step ``s`` the task has drawn batches ``0 … s + k - 1``. Resume stays exact by
checkpointing the in-flight batches ``s … s + k - 1`` themselves (their versions are older than
the checkpoint's weights, so they could not be regenerated from it): :meth:`state_dict` waits
for them and returns them with their prompts as JSON-able lists, and with the settings they were
sampled under (``sampled_under``: the sampling parameters, the engine, ``objective.old_logprobs``
and ``moe.routing_replay``, which decide what a batch carries). A resume that changes one of
those samples the in-flight batches again, with the same prompts and seeds, from the weights it
resumes with (less stale, as after a rollback), and warns: kept, they would train under the new
settings on what the old ones sampled (e.g. log-probs at another temperature, or no behaviour
pass for ``recompute``). The logging cadences (``logging.rollout_check_every``,
``logging.drift_every``) only decide which of them carry the pass that measures staleness: the
resumed run keeps them, and its first k steps measure where the checkpointed run's would have.

π_old under staleness (``objective.old_logprobs``): ``rollout``: the behaviour policy's log-probs
as the engine recorded them; ``recompute``: the behaviour policy's log-probs by the trainer's own
fp32 pass, run in the engine process on the behaviour weights (in the synchronous loop both
name the policy that sampled, which is then the current one). Metrics (``async/*``):
staleness of the rows; the staleness drift log π_v − log π_t (trainer passes on the behaviour
and on the current weights: the change of the policy between sampling and this step), kept
apart from the engine mismatch log π_engine,v − log π_trainer,v (same weights, different
code) and from the policy drift of the update itself. For an MoE policy the engine process's
pass also records the experts the behaviour policy chose (``Rollout.trainer_routing``): π_old's
routing, which R2 replays; :func:`staleness_routing_metrics` measures how far staleness moved it.
Under R3 the update replays the rollout's experts (merged with that pass's where the sampler saw
nothing): with ``recompute`` the pass then runs again under those experts where they differ from
its own (``Rollout.replayed_logprobs``), and that is the loss's π_old, routed as π_θ is (the ratio
is 1 at θ = θ_old); ``trainer_logprobs`` stay the pass on its own experts, for the metrics.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

from gspo.config import ConfigError
from gspo.data.base import Example
from gspo.rollout.async_engine import (
    AsyncEngine,
    Recompute,
    Request,
    ThreadLending,
    decode,
    merge_encoded,
    split_request,
)
from gspo.rollout.batch import Rollout
from gspo.rollout.engine import EngineOptions
from gspo.rollout.remote_engine import RemoteEngine
from gspo.trainer.moe_hooks import routing_change_stats

# What each rank's own engine(s) took for its batch; logged as the slowest rank's
# (gspo.trainer.metrics.max_over_ranks), as is time/publish_send_s.
ENGINE_TIMES = ("time/rollout_engine_s", "async/engine_sync_s")


def behaviour_version(step: int, k: int) -> int:
    """The policy version that samples the batch of ``step`` (0-based) under ``k`` steps of
    staleness."""
    return max(0, step - k)


class _Engines:
    """Several engines for one trainer process, behind one engine's calls: every request split
    by prompt across them (:func:`split_request`), their batches merged back in order, the
    weights published to each."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines

    def publish(self, model: Any, version: int) -> float:
        return sum(e.publish(model, version) for e in self.engines)

    @property
    def last_send_s(self) -> float:
        return max(getattr(e, "last_send_s", 0.0) for e in self.engines)

    def submit(self, req: Request) -> None:
        for engine, share in zip(self.engines, split_request(req, len(self.engines))):
            engine.submit(share)

    def idle(self) -> bool:
        return all(e.idle() for e in self.engines)

    @property
    def threads(self) -> int:
        return sum(e.threads for e in self.engines)

    def take(self) -> tuple[int, dict[str, Any]]:
        parts = [e.take() for e in self.engines]
        return parts[0][0], merge_encoded([enc for _, enc in parts])

    def close(self) -> None:
        errors = []
        for e in self.engines:
            try:
                e.close()
            except Exception as err:  # close the others all the same
                errors.append(err)
        if errors:
            raise errors[0]


class AsyncRollout:
    """Asks the engine process for batches ahead, hands them out in step order, publishes
    weights, and carries the in-flight batches through checkpoints."""

    def __init__(self, *, k: int, total_steps: int,
                 draw: Callable[[int], tuple[list[Example], Request]],
                 check: Callable[[int], bool], engine: str, opts: EngineOptions, threads: int,
                 logprob_fn: Callable[..., Any], temperature: float, chunk: int,
                 pad_id: int, device: torch.device | None = None,
                 routing: bool = False, replay: bool = False,
                 addresses: tuple[str, ...] = (), timeout_s: float = 1800.0,
                 engines: int = 1, turns: Any = None, lend_threads: bool = False,
                 sampled_under: dict[str, Any] | None = None,
                 request_for: Callable[[list[Example], int], Request] | None = None) -> None:
        """``draw(step)``: the step's prompts from the task (called once per step, in order);
        ``check(step)``: whether the engine process also runs the trainer's log-prob pass on
        that step's batch (every step for ``old_logprobs=recompute``). ``device``: where the
        engine process samples (the trainer's device; default the CPU). ``routing`` (MoE
        policies): that pass also records its expert choices (``Rollout.trainer_routing``).
        ``replay`` (R3 with ``objective.old_logprobs=recompute``): and runs again under the
        experts the update replays where they differ (``Rollout.replayed_logprobs``).
        ``engines``: how many engines sample this process's batches, each a share of the
        prompts. ``addresses`` (one per engine): meet engines started with
        ``gspo engine ADDRESS`` there (:class:`gspo.rollout.remote_engine.RemoteEngine`)
        instead of spawning them here, waiting ``timeout_s`` for each to join and for each of
        its messages. ``turns`` (``rollout.max_turns > 1``): the engines
        sample multi-turn episodes, each request carrying its prompts' examples.
        ``lend_threads``: the trainer borrows the engines' threads while they are idle
        (:class:`ThreadLending`; engines spawned here only). ``sampled_under``: the settings
        (option name: value) that decide what a batch is, checkpointed with the in-flight
        batches; ``request_for(examples, step)``: a pipeline batch's request again (the same
        prompts and seeds), for the in-flight batches a resume that changed those settings
        samples again (see :meth:`load_state_dict`)."""
        self.k, self.total, self.draw, self.check = k, total_steps, draw, check
        self.engine_name, self.opts, self.threads = engine, opts, threads
        self.addresses, self.n_engines, self.turns = addresses, engines, turns
        self.timeout_s = timeout_s
        self.device = device if device is not None else torch.device("cpu")
        self.recompute = Recompute(logprob_fn, temperature, chunk, pad_id, routing, replay)
        self.engine: AsyncEngine | RemoteEngine | _Engines | None = None
        self.submitted = 0  # batches 0 … submitted-1 have been drawn and asked for
        self.floor = 0  # the oldest version the engine was given (resume: the checkpoint's)
        self.published = -1  # the newest version published
        # by request key: a step (its pipeline batch), or (step, draw) for an extra draw
        self.inflight: dict[int | tuple[int, int], list[Example]] = {}
        self.ready: dict[int | tuple[int, int], tuple[list[Example], dict[str, Any]]] = {}
        self.sampled_under = dict(sampled_under or {})
        self.request_for = request_for
        # a resume under other settings: the checkpoint's in-flight batches, sampled again
        # from the resumed weights (the floor) by the first _fill
        self.resample: list[tuple[int, list[Example]]] = []
        if lend_threads and addresses:
            raise ConfigError("rollout.async_lend_threads: the engines started with gspo engine "
                              "(rollout.async_address) run on their own cores, not this "
                              "trainer's")
        self.lend_threads = lend_threads
        self.lending: ThreadLending | None = None

    def start(self, model: Any, tokenizer: Any, *, version: int) -> None:
        """Start the engine process on ``model``'s weights, policy version ``version``."""
        self.floor = self.published = version
        started: list[Any] = []
        try:
            for i in range(self.n_engines):
                if self.addresses:
                    started.append(RemoteEngine(
                        model, tokenizer, address=self.addresses[i], engine=self.engine_name,
                        opts=self.opts, steps_ahead=self.k, threads=self.threads,
                        recompute=self.recompute, version=version, turns=self.turns,
                        timeout_s=self.timeout_s))
                else:
                    started.append(AsyncEngine(
                        model, tokenizer, engine=self.engine_name, opts=self.opts,
                        steps_ahead=self.k, threads=self.threads, recompute=self.recompute,
                        version=version, device=self.device, turns=self.turns,
                        # borrowing while the trainer waits: one engine only (several
                        # would each take the trainer's threads)
                        lend_threads=self.lend_threads and self.n_engines == 1))
        except BaseException:
            _Engines(started).close()
            raise
        self.engine = started[0] if len(started) == 1 else _Engines(started)
        if self.lend_threads:
            self.lending = ThreadLending(torch.get_num_threads(), self.engine.threads,
                                         self.engine.idle)

    def poll_threads(self) -> None:
        """The trainer's threads for now (:class:`ThreadLending`; nothing without lending)."""
        if self.lending is not None:
            self.lending.poll()

    def _fill(self, step: int) -> None:
        # a resume under other settings: the checkpoint's in-flight batches again, from the
        # resumed weights, in step order before any later batch (see load_state_dict)
        for b, examples in self.resample:
            self._ask(self.request_for(examples, b), examples, version=self.floor)
        self.resample = []
        for b in range(self.submitted, min(step + self.k, self.total - 1) + 1):
            examples, req = self.draw(b)
            # An extended run (resumed with more steps than it had) never drew its last k
            # batches, and their versions are gone: those come from the resumed weights.
            self._ask(req, examples, version=max(behaviour_version(b, self.k), self.floor))
            self.submitted = b + 1

    def _ask(self, req: Request, examples: list[Example], *, version: int, draw: int = 0
             ) -> None:
        """Ask the engine for ``req`` on policy ``version`` (with the trainer's pass on the
        steps ``check`` names; a multi-turn request with its examples), in flight under its
        key from then on."""
        req = dataclasses.replace(req, version=version, recompute=self.check(req.step),
                                  draw=draw,
                                  examples=examples if self.turns is not None else None)
        self.engine.submit(req)
        self.inflight[req.key] = examples
        self.poll_threads()  # the engine samples now: back to the trainer's own threads

    def _take_one(self) -> None:
        key, enc = self.engine.take()
        self.ready[key] = (self.inflight.pop(key), enc)

    def next(self, step: int) -> tuple[list[Example], Rollout]:
        """The batch of ``step``; its staleness and the engine's time in ``Rollout.extras``."""
        self._fill(step)
        while step not in self.ready:
            if step not in self.inflight:
                raise RuntimeError(f"batch of step {step} was never asked for")
            self._take_one()
        examples, enc = self.ready.pop(step)
        roll = decode(enc)
        # time/rollout_s is the trainer's wait for the batch; the engine's own time is apart
        roll.extras = {**roll.extras,  # a multi-turn batch's rollout/turns_mean etc.
                       "time/rollout_engine_s": enc["generate_s"],
                       # an engine's sync of its own copy of the weights (bf16, vLLM) or the
                       # GPU engine's load of the slot onto the device, part of
                       # time/rollout_engine_s
                       "async/engine_sync_s": enc.get("sync_s", 0.0),
                       **staleness_metrics(step, roll.versions, self.k)}
        return examples, roll

    def extra(self, step: int, draw: int, examples: list[Example], req: Request) -> Rollout:
        """Dynamic sampling's extra draw ``draw`` of ``step``, sampled by the engine process
        on this step's weights (version ``step``, the newest published), after the batches
        already asked for (FIFO). Its rows carry that version, and the trainer's pass on it
        when this step's batch does."""
        self._ask(req, examples, version=step, draw=draw)
        key = (step, draw)
        while key not in self.ready:
            self._take_one()
        return decode(self.ready.pop(key)[1])

    def publish(self, model: Any, version: int) -> float:
        """Publish version ``version``; to engines started elsewhere its weights go in the
        background (:meth:`gspo.rollout.remote_engine.RemoteEngine.publish`). The seconds the
        trainer spent on it."""
        seconds = self.engine.publish(model, version)
        self.published = version
        return seconds

    def rolled_back(self, model: Any, *, version: int, kept: int,
                    request_for: Callable[[list[Example], int], Request]) -> int:
        """The trainer's weights were rolled back to those of version ``kept``: publish them as
        ``version`` (the step about to run; nothing asked for it yet), and sample every batch
        asked for from a version newer than ``kept`` (weights the rollback discarded) again,
        from them: ``request_for(examples, step)`` rebuilds its request (the same prompts and
        seeds). Waits for the batches in flight first. How many batches it asked for again."""
        self.publish(model, version)
        while self.inflight:
            self._take_one()
        again = sorted(key for key, (_, enc) in self.ready.items()
                       if isinstance(key, int) and max(enc["versions"]) > kept)
        for step in again:
            examples, _ = self.ready.pop(step)
            self._ask(request_for(examples, step), examples, version=version)
        self.floor = version
        return len(again)

    def publish_metrics(self) -> dict[str, float]:
        """After a publish to engines started elsewhere, ``time/publish_send_s``: how long
        the previous publish's broadcast took (it ran while this step trained; the slowest
        engine's with several; under torchrun the trainer logs the slowest rank's). Local
        engines: none (their publish is the copy itself)."""
        if not self.addresses:
            return {}
        return {"time/publish_send_s": float(self.engine.last_send_s)}

    def state_dict(self) -> dict[str, Any]:
        """The in-flight batches (waited for), their prompts, and where the draws stand."""
        while self.inflight:
            self._take_one()
        ready = {str(s): {"examples": [dataclasses.asdict(e) for e in ex], "rollout": enc}
                 for s, (ex, enc) in sorted(self.ready.items())}
        return {"k": self.k, "submitted": self.submitted, "ready": ready,
                "sampled_under": self.sampled_under}

    def load_state_dict(self, state: dict[str, Any], rank: int = 0, world_size: int = 1
                        ) -> None:
        """``state["ready"]``: :meth:`state_dict`'s, or under torchrun a list of every rank's
        (each rank sampled its own share of the prompts); this is ``rank`` of ``world_size``.
        In-flight batches sampled under other settings than this run's (``sampled_under``;
        a checkpoint without them: taken as this run's) are sampled again, from the weights
        resumed with (the version :meth:`start` gets), with a warning naming the settings."""
        if state["k"] != self.k:
            raise ConfigError(f"resume: the run was checkpointed with rollout.async_steps="
                             f"{state['k']}, not {self.k}")
        per_rank = state["ready"] if isinstance(state["ready"], list) else [state["ready"]]
        if len(per_rank) != world_size:
            raise ConfigError(f"resume: the checkpoint's in-flight batches were sampled by "
                              f"{len(per_rank)} trainer process(es), each its share of the "
                              f"prompts; resume with {len(per_rank)}, not {world_size}")
        self.submitted = state["submitted"]
        self.ready = {int(s): ([Example(**e) for e in v["examples"]], v["rollout"])
                      for s, v in per_rank[rank].items()}
        saved = state.get("sampled_under", {})
        changed = [f"{key}={saved[key]} (now {value})" for key, value in self.sampled_under.items()
                   if key in saved and saved[key] != value]
        if changed and self.ready:
            if self.request_for is None:
                raise ConfigError(f"resume: the checkpoint's in-flight batches were sampled with "
                                  f"{', '.join(changed)}; resume with the run's own settings")
            warnings.warn(f"resume: the checkpoint's {len(self.ready)} in-flight batch(es) were "
                          f"sampled with {', '.join(changed)}: sampled again, with the same "
                          "prompts and seeds, from the weights resumed with", stacklevel=2)
            self.resample = [(s, ex) for s, (ex, _) in sorted(self.ready.items())]
            self.ready = {}

    def close(self) -> None:
        if self.lending is not None:
            self.lending.restore()
        if self.engine is not None:
            self.engine.close()


def staleness_metrics(step: int, versions: list[int], k: int) -> dict[str, float]:
    """``async/staleness_{mean,max,min}``: how many updates behind ``step`` the rows' policy
    versions are; ``async/staleness_frac_{s}`` for s = 0 … ``k`` (the bound): the share of
    rows s updates behind (the distribution; the same keys every step)."""
    lag = torch.tensor([step - v for v in versions], dtype=torch.float64)
    return {"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max()),
            "async/staleness_min": float(lag.min()),
            **{f"async/staleness_frac_{s}": float((lag == s).double().mean())
               for s in range(k + 1)}}


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(1) / mask.sum(1).clamp(min=1)


def staleness_routing_metrics(behaviour: list[torch.Tensor] | None,
                              current: list[torch.Tensor], mask: torch.Tensor,
                              dist: Any = None) -> dict[str, float]:
    """How far staleness moved an MoE policy's routing: over the response tokens, the share of
    (token, layer) whose expert set differs between the behaviour policy's pass
    (``behaviour``, per layer ``[N, k]``) and this step's (``current``), and the share of the
    behaviour policy's experts replaced (``async/staleness_{routing,expert}_change``). Under
    torchrun (``dist``) each rank's share is weighted by its response tokens: the global
    batch's share."""
    if behaviour is None:
        return {}
    stats = routing_change_stats(behaviour, current, mask)  # the update's own measure
    shares = torch.stack([stats["moe/routing_change"].double().cpu(),
                          stats["moe/expert_change"].double().cpu()])
    n = mask.sum().double().cpu()
    if dist is not None and dist.enabled:
        total = dist.all_reduce(torch.cat([shares * n, n.view(1)]))
        shares = total[:2] / total[2].clamp(min=1)
    return {"async/staleness_routing_change": float(shares[0]),
            "async/staleness_expert_change": float(shares[1])}


def drift_metrics(engine_lp: torch.Tensor, behaviour_lp: torch.Tensor | None,
                  current_lp: torch.Tensor | None, mask: torch.Tensor, dist: Any = None
                  ) -> dict[str, float]:
    """Staleness drift and engine mismatch, per sequence (mean over its tokens), all [N, T].

    ``engine_lp``: log π_v as the engine recorded it; ``behaviour_lp``: log π_v by the trainer's
    pass on the same (behaviour) weights; ``current_lp``: log π_t by the trainer's pass on the
    weights of this step. Either trainer pass may be missing on a step (not logged then).
    Under torchrun (``dist``: the run's :class:`gspo.trainer.distributed.Dist`) the sequences of
    every rank count: each rank's per-sequence values are gathered first.
    """
    def rows(x: torch.Tensor) -> torch.Tensor:
        v = _row_mean(x, mask).detach().cpu()
        return v if dist is None else dist.gather(v)[0]

    out: dict[str, float] = {}
    if behaviour_lp is not None:
        gap = rows(engine_lp - behaviour_lp)
        out["async/engine_mismatch_mean"] = float(gap.mean())
        out["async/engine_mismatch_abs_max"] = float(gap.abs().max())
    if behaviour_lp is not None and current_lp is not None:
        drift = rows(behaviour_lp - current_lp)
        out["async/staleness_drift_mean"] = float(drift.mean())
        out["async/staleness_drift_abs_mean"] = float(drift.abs().mean())
        out["async/staleness_drift_abs_max"] = float(drift.abs().max())
    if current_lp is not None:  # what the trainer's check sees: both effects together
        total = rows(engine_lp - current_lp)
        out["async/behaviour_gap_abs_mean"] = float(total.abs().mean())
    return out
