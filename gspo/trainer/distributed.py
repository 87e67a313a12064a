"""Multi-process training on torch.distributed: one process per device, started by torchrun.

One RL step on W ranks (docs/scaling.md draws it):

* rollout: every rank draws the same B prompts (same seed, same data state) and keeps a
  contiguous share of them with all their G samples, so group-normalised advantages need no
  communication; sampling is seeded per (seed, step, prompt index), not per rank;
* rewards: each rank scores its own rows, then the rewards are all-gathered, so batch-scaled
  advantages, reward metrics and the unscorable check see the global batch on every rank;
* update: every rank walks the same minibatches of the *global* rollout batch and computes
  the rows of each that it holds; each scales its loss so that, after the DDP / FSDP2 gradient
  average, the optimised objective is the mean over the global minibatch's rows (see
  :func:`gspo.trainer.update.policy_update`);
* metrics: sums and counts are all-reduced, so means (clip fractions, KL, ...) are global.

``strategy`` ``ddp`` replicates the policy; ``fsdp2`` shards parameters, gradients and optimizer
state (``fully_shard`` on every decoder layer and on the whole model) and gathers the full
weights for generation only.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from gspo.config import ConfigError, DistributedConfig
from gspo.rollout.batch import share
from gspo.rollout.gloo_net import IFNAME, interface_towards_master

_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}


@dataclass
class Dist:
    """This process's place in the job and the collectives the trainer uses.

    With ``world_size == 1`` (a plain ``gspo train``) every method is the identity, so the
    single-process code path is unchanged.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    strategy: str = "none"  # "none" (one process), "ddp" or "fsdp2"
    engine: Any = None  # what the training forward is called through: DDP wrapper / FSDP root

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that writes the run folder, logs and checkpoints."""
        return self.rank == 0

    def shard(self, n: int) -> tuple[int, int]:
        """``[lo, hi)``: this rank's contiguous share of ``n`` items (the first ``n % W`` ranks
        get one more), e.g. the step's prompts."""
        return share(n, self.world_size, self.rank)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``op`` ("sum", "max", "min") over ranks of a tensor of the same shape on every rank;
        returns a new tensor on ``t``'s device."""
        if not self.enabled:
            return t
        x = t.detach().to(self.device, copy=True)
        tdist.all_reduce(x, op=_OPS[op])
        return x.to(t.device)

    def gather(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Concatenate every rank's 1-D ``t`` in rank order (lengths may differ); also return
        where this rank's part starts in the result."""
        if not self.enabled:
            return t, 0
        n = torch.tensor([t.numel()], device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        tdist.all_gather(sizes, n)
        counts = [int(s) for s in sizes]
        buf = torch.zeros(max(counts), dtype=t.dtype, device=self.device)
        buf[: t.numel()] = t.to(self.device)
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        tdist.all_gather(parts, buf)
        out = torch.cat([p[:c] for p, c in zip(parts, counts)]).to(t.device)
        return out, sum(counts[: self.rank])

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    # ------------------------------------------------------------------ the policy
    def forward(self, model: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(model, *args, **kwargs)``, run as the policy's forward call.

        DDP prepares its gradient all-reduce, and FSDP2 gathers the parameters that belong to
        the whole model (embeddings, final norm, output layer) and registers their
        reduce-scatter, in hooks around the wrapped module's call. gspo's log-prob code calls
        the backbone and the output layer's weight directly, so it must run *inside* that call.
        """
        if self.engine is None:
            return fn(model, *args, **kwargs)
        return run_as_forward(self.engine, model, fn, *args, **kwargs)

    @contextlib.contextmanager
    def full_weights(self, model: Any) -> Iterator[None]:
        """FSDP2: gather every parameter once and keep it gathered inside the block.

        Generation runs a different number of forward calls on each rank (their responses
        end at different lengths); with per-layer all-gathers those collectives would not
        match. A no-op for DDP and a single process.
        """
        if self.strategy != "fsdp2" or not self.enabled:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        model.set_reshard_after_forward(False)
        for m in modules:
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
            model.set_reshard_after_forward(True)  # layers: free their weights after forward
            model.set_reshard_after_forward(False, recurse=False)  # the root: FSDP's default


def run_as_forward(engine: Any, model: Any, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
    """Call ``engine`` (``model`` itself, or a DDP wrapper around it) with ``model.forward``
    replaced by ``fn(model, ...)`` for this one call, so that the wrapper's hooks run around
    ``fn``. Nested ``model(...)`` calls inside ``fn`` reach the real forward."""

    def forward(*a: Any, **k: Any) -> Any:
        model.__dict__.pop("forward", None)
        return fn(model, *a, **k)

    model.forward = forward
    try:
        return engine(*args, **kwargs)
    finally:
        model.__dict__.pop("forward", None)


# ---------------------------------------------------------------------- setup and teardown
def resolve_device(name: str) -> torch.device:
    """The ``device`` option as a torch device: ``auto`` is the GPU when torch sees one, else
    the CPU. Asking for a GPU that is not there is a :class:`ConfigError`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU build" if torch.version.cuda is None
                   else "torch sees no GPU")
            raise ConfigError(f"device={name}: CUDA is not available ({why}); use device=cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={name}: only {torch.cuda.device_count()} GPU(s) visible")
    return dev


def init_from_env(strategy: str, device: torch.device | None = None) -> Dist:
    """Join the process group that torchrun's variables describe (``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL on GPUs, else gloo. ``device``: the
    resolved ``device`` option (default: the GPU when there is one). A process started without
    them (``WORLD_SIZE`` unset or 1) gets the one-process Dist on ``device``. With gloo and a
    world that spans machines, ``GLOO_SOCKET_IFNAME`` (when unset) is set to the interface
    the other machines reach this one through
    (:func:`gspo.rollout.gloo_net.interface_towards_master`)."""
    if device is None:
        device = resolve_device("auto")
    if not tdist.is_available():
        return Dist(device=device)
    if not tdist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return Dist(device=device)
        if device.type != "cuda" and (name := interface_towards_master()) is not None:
            # gloo binds to where the host name resolves, often loopback: bind where the other
            # machines reach this one instead (gspo.rollout.gloo_net)
            os.environ[IFNAME] = name
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = tdist.get_world_size()
    if world == 1:
        return Dist(device=device)
    local = int(os.environ.get("LOCAL_RANK", tdist.get_rank()))
    device = torch.device("cpu")
    if tdist.get_backend() == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    return Dist(rank=tdist.get_rank(), world_size=world, local_rank=local, device=device,
                strategy=strategy)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: modules whose class the model lists in
    ``_no_split_modules`` (every Hugging Face causal LM does), outermost ones only."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers: list[torch.nn.Module] = []
    for m in model.modules():
        if type(m).__name__ in names and not any(m in set(x.modules()) for x in layers):
            layers.append(m)
    if not layers:
        raise ConfigError(f"dist.strategy=fsdp2: found no decoder layers in {type(base).__name__}"
                          " (no _no_split_modules); use dist.strategy=ddp")
    return layers


def wrap(model: Any, d: Dist) -> Any:
    """Apply ``d.strategy`` to ``model`` (in place for FSDP2); returns the engine to call."""
    if d.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [d.local_rank] if d.device.type == "cuda" else None
        # No buffer broadcast: generation calls the inner model a different number of times
        # on each rank, and the only buffers (rotary tables) are equal on every rank anyway.
        return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings, final norm, output layer
    return model


def _check(cfg: Any, d: Dist) -> None:
    if cfg.rollout.prompts_per_step < d.world_size:
        raise ConfigError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must be "
                          f">= the number of processes ({d.world_size}): each rank samples "
                          "whole groups")


def prepare(cfg: Any, model: Any, ref_model: Any = None) -> Dist:
    """The setup hook: join the job and wrap the policy for ``cfg.dist.strategy``.

    Runs after the policy is final (LoRA, activation checkpointing, reference copy) and
    before the optimizer is built, because FSDP2 replaces the parameters with sharded ones.
    In one process (no torchrun, or a world of one) a ``dist.strategy`` other than the
    default warns: nothing is sharded or replicated then (not an error: the config a torchrun
    job runs stays the one-process run's too, docs/scaling.md).
    """
    d = init_from_env(cfg.dist.strategy, resolve_device(cfg.device))
    if d.enabled:
        _check(cfg, d)
    elif cfg.dist.strategy != DistributedConfig.strategy:
        warnings.warn(f"dist.strategy={cfg.dist.strategy} applies under torchrun with more than "
                      "one process; this is one process, which trains the whole policy "
                      "itself (nothing is sharded)", stacklevel=2)
    if d.device.type == "cuda" and d.device.index is not None:
        torch.cuda.set_device(d.device)
    model.to(d.device)  # a no-op when the policy is already there (one process on the CPU)
    if ref_model is not None:
        ref_model.to(d.device)
    if d.enabled:
        d.engine = wrap(model, d)
    return d


def shutdown(*, barrier: bool = True) -> None:
    """Leave the process group cleanly (the caller drops its policy and optimizer first: FSDP2
    can abort at exit, "terminate called ...", when they outlive the group).
    ``barrier=False`` after an error: the other ranks may be waiting in another collective."""
    gc.collect()
    if tdist.is_available() and tdist.is_initialized():
        if barrier:
            tdist.barrier()
        tdist.destroy_process_group()


# ---------------------------------------------------------------------- checkpoints
def full_model_state(model: Any, d: Dist) -> dict[str, torch.Tensor] | None:
    """Full CPU state dict for ``save_pretrained(state_dict=...)``: a collective under FSDP2
    (call it on every rank; rank 0 gets the tensors); ``None`` (use the module's own) else.
    Tied parameters (an output layer tied to the embeddings) share one tensor in it, as in
    the module's own state dict, so that ``save_pretrained`` writes them once, as for one
    process (gathered, each name had a copy of its own, and both were written)."""
    if d.strategy != "fsdp2" or not d.enabled:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied = first.setdefault(id(p), name)
        if tied != name and tied in state and name in state:
            state[name] = state[tied]
    return state


def full_state_loader(d: Dist) -> Callable[[Any, dict[str, torch.Tensor]], Any] | None:
    """How a full state dict (every rank holds every tensor, as read from a checkpoint) goes
    into the model: under FSDP2 ``set_model_state_dict``, which keeps each rank's shard of it
    (``load_state_dict`` cannot copy plain tensors into sharded parameters); None (the
    module's own ``load_state_dict``) else. The loader returns the missing and unexpected
    keys."""
    if d.strategy != "fsdp2" or not d.enabled:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    def load(model: Any, weights: dict[str, torch.Tensor]) -> Any:
        for m in model.modules():  # a forward with no backward after it (the drift pass)
            if isinstance(m, FSDPModule):  # leaves the root's parameters gathered
                m.reshard()
        return set_model_state_dict(model, weights, options=StateDictOptions(
            full_state_dict=True, strict=False))
    return load


def optimizer_state(model: Any, optimizer: Any, d: Dist) -> dict[str, Any]:
    """The optimizer state to write into ``optimizer.pt``: ``optimizer.state_dict()``, or under
    FSDP2 the full, parameter-name-keyed state (a collective; complete on rank 0).

    Before the first step (the step-0 checkpoint of ``save_every``) there is no state, and
    ``get_optimizer_state_dict`` would create one by an optimizer step on zero gradients, which
    counts as AdamW's first step: every later update would then be bias-corrected for one step
    too many (0.78x the size of the one-process run's on the first steps, measured). So that
    checkpoint keeps the plain, empty state."""
    if d.strategy != "fsdp2" or not d.enabled or not optimizer.state:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))


def group_settings(optimizer: Any) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, betas, weight decay, …; not its parameters): what
    :func:`load_optimizer_state` overwrites with the saved run's, for a caller that keeps
    this run's (a resume with changed ``optim.*``, a guard rollback)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def load_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any], d: Dist) -> None:
    """Inverse of :func:`optimizer_state`, across strategies and world sizes: a state keyed by
    parameter index (one process, DDP) or by parameter name (FSDP2) loads into any run."""
    by_index = all(isinstance(k, int) for k in state.get("state", {}))
    # an empty state (a step-0 checkpoint) loads as it is: set_optimizer_state_dict would
    # first create one by a zero-gradient step (see optimizer_state)
    if by_index and (d.strategy != "fsdp2" or not d.enabled or not state.get("state")):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    if by_index:  # index i: the i-th parameter of the optimizer's groups, in group order (not
        # model order when there are several groups, e.g. moe.router_lr_scale's routers last)
        name_of = {id(p): n for n, p in model.named_parameters()}
        names = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
        state = {"state": {names[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                  for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state,
                             options=StateDictOptions(full_state_dict=True))


def save_sharded(path: str | Path, model: Any, optimizer: Any) -> None:
    """Every rank writes its own shards of weights and optimizer state with
    ``torch.distributed.checkpoint`` (no full copy in any one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))


def load_sharded(path: str | Path, model: Any, optimizer: Any) -> None:
    """Load a :func:`save_sharded` checkpoint; the world size and strategy may differ from the
    run that wrote it (DCP reshards on load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


__all__ = [
    "Dist",
    "decoder_layers",
    "full_model_state",
    "init_from_env",
    "load_optimizer_state",
    "load_sharded",
    "optimizer_state",
    "prepare",
    "resolve_device",
    "run_as_forward",
    "save_sharded",
    "shutdown",
    "wrap",
]
