"""``rollout.async_steps = k > 0``: the rollout engine in its own process, k steps ahead.

The trainer keeps its policy; the engine process samples from copies of it held in shared
memory (one machine). There are ``k + 1`` weight *slots*; policy version ``v`` (the weights
after ``v`` updates) lives in slot ``v % (k + 1)``. :meth:`AsyncEngine.publish` copies the
policy into its slot after every update (when the step that uses it starts);
:meth:`AsyncEngine.submit` asks for a batch sampled from a given version;
:meth:`AsyncEngine.take` returns finished batches in submission order.

Why ``k + 1`` slots are enough without any lock: the batch of step ``t`` is sampled from
version ``max(0, t - k)`` (see :mod:`gspo.trainer.async_rollout`), and the trainer publishes
version ``v`` only after it has taken the batch of step ``v - 1``, the last batch that reads
version ``v - k - 1``, whose slot ``v`` overwrites. The slot's version number is stored next
to its weights and checked before every batch, so a violation is an error, never silent.

Each slot is one flat shared buffer per dtype (one file descriptor, however many tensors the
model has); the engine process rebuilds the model around views of it from a weightless
(meta-device) copy. Results travel back as plain Python lists (an fp32 value round-trips
through a Python float exactly), not as one shared tensor per row.

On a GPU the slots stay in shared CPU memory (the trainer's publish is one device-to-host
copy per dtype) and the engine process keeps one model on the device, itself views of one
flat device buffer per dtype: before a batch from another version it copies that slot in,
one host-to-device copy per dtype (for a LoRA policy, after the first, only the adapter's
tensors, packed into one copy per dtype).

A LoRA policy's base weights never change: each slot gets the whole policy the first time it
is filled and, after that, only the tensors an update can change (:func:`changing`: the
adapter), so a publish copies megabytes where the whole policy is gigabytes.

An engine that samples from the module it is given (``shares_policy_weights``: ``hf`` at
fp32) samples each slot's model as it is. One with its own copy of the weights (``hf`` at
``rollout.precision=bf16``, ``vllm``) is started once in the engine process and synced from a
slot (``sync_weights``) whenever the next batch needs another version than the one it holds.
An engine started elsewhere (``gspo engine ADDRESS``, :mod:`gspo.rollout.remote_engine`) runs
the same loop (:func:`run_engine`) on weights it receives by ``torch.distributed`` broadcast.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import functools
import io
import queue
import signal
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from gspo.models.lean_forward import at_layer_boundaries
from gspo.models.lora import is_peft
from gspo.models.moe import capture_routing, merge_rollout_routing, replay_routing
from gspo.models.twin import meta_twin
from gspo.rollout.batch import Rollout, join_replayed, join_routing, pad_batch, share
from gspo.rollout.engine import EngineOptions, build_engine, engine_capabilities
from gspo.rollout.multiturn import engine_sampler
from gspo.rollout.sampler import SamplingParams

POLL_S = 1.0  # how often a waiting trainer checks that the engine process is still alive


@dataclass(frozen=True)
class _Entry:
    """Where one named tensor of the model lives in a slot: its dtype's flat buffer, offset."""

    module: str
    attr: str
    is_param: bool
    dtype: str
    offset: int
    shape: tuple[int, ...]


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, str, bool, torch.Tensor]]:
    """(module path, attribute, is parameter, tensor) of every parameter and buffer, tied
    ones listed under each of their names."""
    out = []
    for mname, mod in model.named_modules(remove_duplicate=False):
        out += [(mname, a, True, p) for a, p in mod._parameters.items() if p is not None]
        out += [(mname, a, False, b) for a, b in mod._buffers.items() if b is not None]
    return out


def _layout(model: torch.nn.Module) -> tuple[list[_Entry], dict[str, int]]:
    """One entry per (module, attribute); tied tensors share their offset. Sizes per dtype."""
    seen: dict[int, tuple[str, int]] = {}
    sizes: dict[str, int] = {}
    entries = []
    for mname, attr, is_param, t in _named_tensors(model):
        key = str(t.dtype).removeprefix("torch.")
        if id(t) not in seen:
            seen[id(t)] = (key, sizes.get(key, 0))
            sizes[key] = sizes.get(key, 0) + t.numel()
        key, offset = seen[id(t)]
        entries.append(_Entry(mname, attr, is_param, key, offset, tuple(t.shape)))
    return entries, sizes


def _skeleton(model: torch.nn.Module) -> bytes:
    """The model pickled without its weights: every tensor replaced by a meta tensor. An FSDP2
    policy (which cannot be deep-copied; its weights gathered by the caller) is rebuilt from
    its class and config on the meta device, with the same named tensors checked."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        twin = meta_twin(model)
        have = {(m, a): tuple(t.shape) for m, a, _, t in _named_tensors(twin)}
        want = {(m, a): tuple(t.shape) for m, a, _, t in _named_tensors(model)}
        if not want.items() <= have.items():
            raise RuntimeError(f"rollout.async_steps with FSDP2: {type(twin).__name__} "
                               "rebuilt from its config does not have the policy's modules; "
                               "use dist.strategy=ddp")
    else:
        memo: dict[int, Any] = {}
        for _, _, is_param, t in _named_tensors(model):
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(meta, requires_grad=False) if is_param else meta
        twin = copy.deepcopy(model, memo)
    buf = io.BytesIO()
    torch.save(twin, buf)
    return buf.getvalue()


def _views(entries: list[_Entry], slot: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each entry's tensor as a view of its slot buffer."""
    return [slot[e.dtype][e.offset:e.offset + _numel(e.shape)].view(e.shape) for e in entries]


def _copy_flat(slot: dict[str, torch.Tensor], entries: list[_Entry], unique: list[int],
               srcs: list[torch.Tensor]) -> None:
    """Fill ``slot`` from ``srcs`` with one copy per dtype: the distinct tensors of a dtype,
    in entry order, lie back to back in its buffer (:func:`_layout` gives them their offsets
    in that order), so their concatenation is the whole buffer."""
    for key, buf in slot.items():
        parts = [srcs[i].detach().reshape(-1) for i in unique if entries[i].dtype == key]
        buf.copy_(torch.cat(parts))


def pack(entries: list[_Entry], only: list[int], model: torch.nn.Module,
         out: dict[str, torch.Tensor]) -> None:
    """``model``'s tensors of ``entries[i]``, ``i`` in ``only``, back to back in one buffer per
    dtype (``out``, from :func:`packed_buffers`): what a publish of only those sends."""
    pack_tensors(entries, only, [t for *_, t in _named_tensors(model)], out)


def pack_tensors(entries: list[_Entry], only: list[int], srcs: list[torch.Tensor],
                 out: dict[str, torch.Tensor]) -> None:
    """:func:`pack` from ``srcs`` (one tensor per entry, e.g. a slot's :func:`_views`)."""
    for key, buf in out.items():
        buf.copy_(torch.cat([srcs[i].detach().reshape(-1) for i in only
                             if entries[i].dtype == key]))


def unpack(entries: list[_Entry], only: list[int], packed: dict[str, torch.Tensor],
           slot: dict[str, torch.Tensor]) -> None:
    """Write :func:`pack`'s buffers into their tensors' places in ``slot``."""
    views = _views(entries, slot)
    at = dict.fromkeys(packed, 0)
    for i in only:
        key, n = entries[i].dtype, _numel(entries[i].shape)
        views[i].copy_(packed[key][at[key]:at[key] + n].view(entries[i].shape))
        at[key] += n


def packed_buffers(entries: list[_Entry], only: list[int] | None) -> dict[str, torch.Tensor]:
    """Empty buffers for :func:`pack` of ``entries[i]``, ``i`` in ``only`` (none: no buffers),
    one per dtype, in the order both ends of a broadcast send and receive them."""
    sizes: dict[str, int] = {}
    for i in only or []:
        sizes[entries[i].dtype] = sizes.get(entries[i].dtype, 0) + _numel(entries[i].shape)
    return {k: torch.empty(n, dtype=getattr(torch, k)) for k, n in sorted(sizes.items())}


def entry_bytes(entries: list[_Entry], idx: list[int]) -> int:
    """Bytes of the tensors of ``entries[i]`` for ``i`` in ``idx``."""
    return sum(_numel(entries[i].shape) * getattr(torch, entries[i].dtype).itemsize
               for i in idx)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _materialize(skeleton: bytes, entries: list[_Entry], slot: dict[str, torch.Tensor]
                 ) -> torch.nn.Module:
    """A model whose parameters and buffers are views of ``slot`` (engine process side)."""
    model = torch.load(io.BytesIO(skeleton), weights_only=False)
    modules = dict(model.named_modules(remove_duplicate=False))
    for e, view in zip(entries, _views(entries, slot)):
        mod = modules[e.module]
        if e.is_param:
            mod._parameters[e.attr] = torch.nn.Parameter(view, requires_grad=False)
        else:
            mod._buffers[e.attr] = view
    return model.eval()


@dataclass(frozen=True)
class Request:
    """One batch to sample: the trainer step it is for, the version to sample from."""

    step: int
    version: int
    prompts: list[list[int]]
    group_size: int
    params: SamplingParams
    seeds: list[int]
    recompute: bool  # also run the trainer's log-prob pass on the batch (Rollout.trainer_logprobs)
    # multi-turn rollouts (rollout.max_turns > 1): each prompt's task example, which resets
    # its rows' environments in the engine process (see run_engine's ``turns``)
    examples: list[Any] | None = None
    # dynamic sampling's extra draw d > 0 of ``step`` (on ``version`` = that step's weights);
    # its batch comes back under the key (step, draw), the pipeline's (draw 0) under step
    draw: int = 0

    @property
    def key(self) -> int | tuple[int, int]:
        return self.step if self.draw == 0 else (self.step, self.draw)


@dataclass(frozen=True)
class Recompute:
    """The trainer's log-prob pass, for the engine process: ``fn(model, ids, attention,
    response_mask, temperature=, chunk=)`` (e.g. the trainer's ``logprob_fn``). ``routing``
    (MoE policies): also record the experts the pass chose (what R2 replays). ``replay``
    (R3 with ``objective.old_logprobs=recompute``, needs ``routing``): also the log-probs of
    the pass under the experts the update replays, the rollout's merged with the pass's own
    (``Rollout.replayed_logprobs``, the loss's π_old), when they differ from its own."""

    fn: Callable[..., Any]
    temperature: float
    chunk: int
    pad_id: int
    routing: bool = False
    replay: bool = False


def _encode_routing(routing: list[torch.Tensor] | None) -> list[list[Any]] | None:
    """Per MoE layer ``[N * T, k]`` expert indices as JSON-able ``[k, flat list]``."""
    return None if routing is None else [[r.shape[-1], r.reshape(-1).tolist()] for r in routing]


def _decode_routing(enc: list[list[Any]] | None) -> list[torch.Tensor] | None:
    if enc is None:
        return None
    return [torch.tensor(flat, dtype=torch.long).view(-1, k) for k, flat in enc]


def _encode(roll: Rollout, trainer_lp: list[list[float]] | None,
            trainer_routing: list[torch.Tensor] | None, version: int,
            seconds: float, sync_s: float = 0.0, *,
            replayed_lp: list[list[float]] | None = None) -> dict[str, Any]:
    return {"prompt_ids": roll.prompt_ids, "response_ids": roll.response_ids,
            "logprobs": [lp.tolist() for lp in roll.logprobs], "truncated": roll.truncated,
            "group_size": roll.group_size, "versions": [version] * len(roll),
            "trainer_logprobs": trainer_lp, "replayed_logprobs": replayed_lp,
            "routing": _encode_routing(roll.routing),
            "trainer_routing": _encode_routing(trainer_routing), "generate_s": seconds,
            "sync_s": sync_s, "model_mask": roll.model_mask, "extras": dict(roll.extras)}


def split_request(req: Request, parts: int) -> list[Request]:
    """``req`` as ``parts`` requests for contiguous shares of its prompts (the first
    ``len % parts`` one more), each with its prompts' seeds. Sampling is seeded per prompt, so
    the shares sample what the whole request would."""
    bounds = [share(len(req.prompts), parts, i) for i in range(parts)]
    return [dataclasses.replace(req, prompts=req.prompts[lo:hi], seeds=req.seeds[lo:hi],
                                examples=None if req.examples is None else req.examples[lo:hi])
            for lo, hi in bounds]


def merge_encoded(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One encoded rollout (:func:`_encode`'s) from those of a request's shares, in order: the
    rows one after the other; ``generate_s`` the longest (the shares sample side by side). MoE
    routing records, laid out per batch (padded to its longest row), are re-padded and joined
    (:func:`gspo.rollout.batch.join_routing`)."""
    rows = [len(p["response_ids"]) for p in parts]

    def routing(key: str) -> list[list[Any]] | None:
        encs = [p[key] for p in parts]
        if all(e is None for e in encs):
            return None
        if any(e is None for e in encs):
            raise ValueError(f"merge_encoded: some shares have {key} and some do not")
        return _encode_routing(join_routing([_decode_routing(e) for e in encs], rows,
                                            complete=key == "trainer_routing"))

    out: dict[str, Any] = {k: [x for p in parts for x in p[k]] for k in (
        "prompt_ids", "response_ids", "logprobs", "truncated", "versions")}
    trainer = [p["trainer_logprobs"] for p in parts]
    out["trainer_logprobs"] = (None if any(t is None for t in trainer)
                               else [x for t in trainer for x in t])
    out["replayed_logprobs"] = join_replayed([p.get("replayed_logprobs") for p in parts],
                                             trainer)
    masks = [p.get("model_mask") for p in parts]
    out["model_mask"] = None if any(m is None for m in masks) else [x for m in masks for x in m]
    # per-row means (multi-turn), row-weighted
    out["extras"] = {k: sum(p["extras"][k] * n for p, n in zip(parts, rows)) / sum(rows)
                     for k in parts[0].get("extras") or {}}
    out.update(group_size=parts[0]["group_size"], routing=routing("routing"),
               trainer_routing=routing("trainer_routing"),
               generate_s=max(p["generate_s"] for p in parts),
               sync_s=max(p.get("sync_s", 0.0) for p in parts))
    return out


def decode(d: dict[str, Any]) -> Rollout:
    """A :class:`Rollout` back from :func:`_encode`'s lists (also used for checkpoints)."""
    f32 = lambda xs: [torch.tensor(x, dtype=torch.float32) for x in xs]  # noqa: E731
    tlp, rlp = d.get("trainer_logprobs"), d.get("replayed_logprobs")
    return Rollout(d["prompt_ids"], d["response_ids"], f32(d["logprobs"]), d["truncated"],
                   d["group_size"], _decode_routing(d.get("routing")),
                   extras=dict(d.get("extras") or {}), model_mask=d.get("model_mask"),
                   versions=d["versions"], trainer_logprobs=None if tlp is None else f32(tlp),
                   trainer_routing=_decode_routing(d.get("trainer_routing")),
                   replayed_logprobs=None if rlp is None else f32(rlp))


@torch.no_grad()
def trainer_pass(model: Any, roll: Rollout, rc: Recompute
                 ) -> tuple[list[list[float]], list[torch.Tensor] | None,
                            list[list[float]] | None]:
    """The trainer's pass on ``roll``: its response tokens' log-probs per row; with
    ``rc.routing``, the experts it chose at every position (pad_batch layout, as the trainer's
    own π_old pass records them); with ``rc.replay`` (R3), when the rollout's experts merged
    with those (:func:`gspo.models.moe.merge_rollout_routing`: what the update replays)
    differ from them, the log-probs of the pass again under the merged experts (the loss's
    π_old, routed as π_θ is), else None (the first pass's are those, bit for bit)."""
    dev = next(model.parameters()).device
    padded = {k: v.to(dev) for k, v in pad_batch(roll.prompt_ids, roll.response_ids,
                                                    rc.pad_id).items()}

    def logprobs() -> list[list[float]]:
        with torch.inference_mode():
            lp = rc.fn(model, padded["input_ids"], padded["attention_mask"],
                       padded["response_mask"], temperature=rc.temperature, chunk=rc.chunk)[0]
        lp = lp.cpu()
        return [lp[i, len(p):len(p) + len(r)].tolist()
                for i, (p, r) in enumerate(zip(roll.prompt_ids, roll.response_ids))]

    record = capture_routing(model) if rc.routing else contextlib.nullcontext(None)
    with record as rec:
        out = logprobs()
    own = rec.take() if rec is not None else None
    replayed = None
    if rc.replay and own is not None:
        merged, _, _ = merge_rollout_routing(roll, own)
        if any(not torch.equal(a, b) for a, b in zip(own, merged)):
            with replay_routing(model, merged):
                replayed = logprobs()
    return out, own, replayed


def _next_request(requests: Any) -> Request | None:
    """The next request; None to stop, also when the trainer process is gone (a SIGKILL
    there must not leave this process behind)."""
    parent = mp.parent_process()
    while True:
        # before every request, not only when none comes: the batches it asked ahead are
        # still in the queue, and no one will read them
        if parent is not None and not parent.is_alive():
            return None
        with contextlib.suppress(queue.Empty):
            return requests.get(timeout=POLL_S)


class _DeviceModel:
    """The engine process's one model on a GPU: views of a flat device buffer per dtype, into
    which :meth:`load` copies a slot (only when the version changes). For a LoRA policy
    (``changing``: the entries an update can change, the adapter; see :func:`changing`) every
    load after the first copies only those, packed into one host buffer per dtype and moved
    to the device in one copy each: the frozen rest is the same in every slot."""

    def __init__(self, skeleton: bytes, entries: list[_Entry], sizes: dict[str, int],
                 device: torch.device, changing: list[int] | None = None) -> None:
        self.buffers = {k: torch.empty(n, dtype=getattr(torch, k), device=device)
                        for k, n in sizes.items()}
        self.model = _materialize(skeleton, entries, self.buffers)
        self.entries, self.changing = entries, changing
        self.host = packed_buffers(entries, changing)  # the adapter, packed on the host
        self.version = -1
        self.last_bytes = 0  # what the last load copied

    @torch.no_grad()
    def load(self, slot: dict[str, torch.Tensor], version: int) -> float:
        """Hold ``version`` (which ``slot`` holds); the seconds it took (0 when held)."""
        if version == self.version:
            return 0.0
        start = time.perf_counter()
        if self.changing is None or self.version == -1:
            for k, buf in self.buffers.items():
                buf.copy_(slot[k])
            self.last_bytes = sum(b.numel() * b.element_size() for b in self.buffers.values())
        else:
            pack_tensors(self.entries, self.changing, _views(self.entries, slot), self.host)
            unpack(self.entries, self.changing,
                   {k: v.to(self.buffers[k].device) for k, v in self.host.items()}, self.buffers)
            self.last_bytes = entry_bytes(self.entries, self.changing)
        if self.buffers and next(iter(self.buffers.values())).is_cuda:
            torch.cuda.synchronize()
        self.version = version
        return time.perf_counter() - start


class _Sampler:
    """The engine process's rollout engine(s). One that samples from the module it is given
    (``shares_policy_weights``: ``hf`` at fp32) runs on each slot's model as it is. One with its
    own copy of the weights (``hf`` at bf16, ``vllm``) is started once and synced from the
    slot a batch needs whenever that batch's version is not the one it holds."""

    def __init__(self, name: str, models: list[torch.nn.Module], tokenizer: Any,
                 opts: EngineOptions) -> None:
        self.models = models
        self.shares = engine_capabilities(name, opts).shares_policy_weights
        self.engines = [build_engine(name, m, tokenizer, opts)
                        for m in (models if self.shares else models[:1])]
        self.synced = -1  # the version the one engine with its own weights holds (-1: none)
        self.sync_s = 0.0  # seconds the last engine_for spent syncing weights

    def engine_for(self, slot: int, version: int) -> Any:
        """The engine that samples ``version``, which ``slot`` holds."""
        self.sync_s = 0.0
        if self.shares:
            return self.engines[slot]
        if version != self.synced:
            start = time.perf_counter()
            self.engines[0].sync_weights(self.models[slot])
            self.synced, self.sync_s = version, time.perf_counter() - start
        return self.engines[0]

    def close(self) -> None:
        for e in self.engines:
            e.close()


def run_engine(skeleton: bytes, entries: list[_Entry], slots: list[dict[str, torch.Tensor]],
               slot_version: Callable[[int, int | None], int], tokenizer: Any, engine: str,
               opts: EngineOptions, threads: int, recompute: Recompute,
               next_request: Callable[[], Request | None], put: Callable[[str, Any], None],
               device: torch.device, turns: Any = None, changing: list[int] | None = None,
               lending: ThreadLending | None = None) -> None:
    """The engine's loop, wherever its weights and requests come from: one model per slot (on
    the CPU) or one device model loaded from the slot a batch needs (GPU), then batches in the
    order they were asked, each ``put("batch", (request key, encoded rollout))``; any failure is
    ``put("error", traceback)``. ``slot_version(slot, wanted)`` is the version a slot holds
    (a transport that receives weights may first wait for ``wanted``; None: do not wait).
    ``turns`` (a :class:`gspo.rollout.multiturn.TurnLoop`): requests that carry their examples
    are sampled as multi-turn episodes, their environments here in the engine process.
    ``changing`` (:func:`changing`, a LoRA policy's adapter): all a GPU model's loads after its
    first copy (:class:`_DeviceModel`). ``lending``: the trainer's threads while it waits for
    a batch (:class:`ThreadLending`; its seconds on them in each batch's
    ``async/engine_borrowed_s``)."""
    try:
        torch.set_num_threads(threads)
        on_device = None
        if device.type == "cpu":
            models = [_materialize(skeleton, entries, s) for s in slots]
        else:
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)
            on_device = _DeviceModel(skeleton, entries, {k: v.numel() for k, v in
                                                         slots[0].items()}, device, changing)
            models = [on_device.model] * len(slots)
        with contextlib.closing(_Sampler(engine, models, tokenizer, opts)) as sampler:
            put("ready", None)
            while (req := next_request()) is not None:
                slot = req.version % len(slots)
                if (held := slot_version(slot, req.version)) != req.version:
                    raise RuntimeError(f"step {req.step} needs policy version {req.version}, but "
                                       f"slot {slot} holds version {held}")
                start = time.perf_counter()
                load_s = on_device.load(slots[slot], req.version) if on_device else 0.0
                engine_now = sampler.engine_for(slot, req.version)
                with (at_layer_boundaries(lending.poll) if lending is not None
                      else contextlib.nullcontext()):
                    if lending is not None:
                        lending.poll()
                    if turns is not None and req.examples is not None:
                        roll = turns.run(engine_sampler(engine_now, req.params), req.examples,
                                         req.prompts, req.seeds, req.group_size)
                    else:
                        roll = engine_now.generate(req.prompts, group_size=req.group_size,
                                                   params=req.params, seeds=req.seeds)
                    tlp, routing, replayed = (trainer_pass(models[slot], roll, recompute)
                                              if req.recompute else (None, None, None))
                if lending is not None:  # back to its own threads while it waits
                    lending.restore()
                    roll.extras = {**roll.extras,
                                   "async/engine_borrowed_s": lending.take_lent_s()}
                if slot_version(slot, None) != req.version:  # overwritten while sampling
                    raise RuntimeError(f"slot {slot} was overwritten while sampling step "
                                       f"{req.step}")
                put("batch", (req.key, _encode(roll, tlp, routing, req.version,
                                                time.perf_counter() - start,
                                                load_s + sampler.sync_s,
                                                replayed_lp=replayed)))
    except BaseException:  # the trainer raises it with this text (see AsyncEngine.take)
        put("error", traceback.format_exc())


def _engine_main(skeleton: bytes, entries: list[_Entry], slots: list[dict[str, torch.Tensor]],
                 slot_versions: torch.Tensor, tokenizer: Any, engine: str, opts: EngineOptions,
                 threads: int, recompute: Recompute, requests: Any, results: Any,
                 device: torch.device, turns: Any, changing: list[int] | None,
                 finished: torch.Tensor, waiting: torch.Tensor | None, borrow: int) -> None:
    """The engine process on this machine: slots in shared memory, requests and batches
    through queues; ``finished`` (shared) counts the requests it is done with; ``waiting``
    (shared, with thread lending) is 1 while the trainer waits for a batch, whose ``borrow``
    threads the engine then uses."""
    # The trainer stops this process (AsyncEngine.close, also at its exit; or its death:
    # _next_request). A Ctrl-C reaches the whole process group, a batch scheduler's SIGTERM
    # every process of the job: the trainer then finishes its step and checkpoints, which
    # waits for the batches in flight here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def put(kind: str, payload: Any) -> None:
        if kind != "ready":
            finished.add_(1)
        results.put((kind, payload))

    def next_request() -> Request | None:
        req = _next_request(requests)
        if req is None:  # the trainer reads no more batches: exit without pushing those
            results.cancel_join_thread()  # it left into the pipe (a full one never drains)
        return req

    run_engine(skeleton, entries, slots, lambda slot, _: int(slot_versions[slot]), tokenizer,
               engine, opts, threads, recompute, next_request, put, device, turns, changing,
               None if waiting is None else ThreadLending(threads, borrow,
                                                          lambda: bool(waiting.item())))


def fill_slot(slot: dict[str, torch.Tensor], entries: list[_Entry], unique: list[int],
              model: torch.nn.Module, *, only: list[int] | None = None) -> None:
    """Copy ``model``'s weights into ``slot`` (``unique``: the first entry of each distinct
    tensor, so tied ones are copied once); ``only``: just those entries (a subset of
    ``unique``, e.g. :func:`changing`), the rest of the slot left as it is."""
    srcs = [t for *_, t in _named_tensors(model)]
    picked = unique if only is None else only
    if all(srcs[i].device.type == "cpu" for i in picked):
        views = _views(entries, slot)
        torch._foreach_copy_([views[i] for i in picked], [srcs[i].detach() for i in picked])
    elif only is None:  # a GPU policy: one device-to-host copy per dtype
        _copy_flat(slot, entries, unique, srcs)
    else:  # a few tensors (an adapter): one copy each
        views = _views(entries, slot)
        for i in picked:
            views[i].copy_(srcs[i].detach())


def changing(model: torch.nn.Module, unique: list[int]) -> list[int] | None:
    """The entries of ``unique`` an update can change: for a PEFT (LoRA) policy its trainable
    parameters, the adapter (the base weights are frozen); None for any other policy: all of
    them (a buffer may be updated outside autograd, so "trainable" is not taken to mean "all
    that changes" there)."""
    if not is_peft(model):
        return None
    named = _named_tensors(model)
    trainable = [i for i in unique if named[i][2] and named[i][3].requires_grad]
    return trainable or None  # none seen trainable (e.g. a wrapper hiding the flags): all


def distinct(entries: list[_Entry]) -> list[int]:
    """Index of the first entry of each distinct tensor (tied tensors share an offset)."""
    first: dict[tuple[str, int], int] = {}
    for i, e in enumerate(entries):
        first.setdefault((e.dtype, e.offset), i)
    return sorted(first.values())


class ThreadLending:
    """``rollout.async_lend_threads``: a process borrows the other side's cores while that
    side waits.

    The trainer and its engine process run on their own torch threads (``num_threads``,
    ``rollout.async_threads``). Once the engine has sampled every batch asked of it, it waits
    for the trainer's next step, and its cores sit idle (on 2 cores at k >= 1, SmolLM2's engine
    works ~2.6 s of a ~4.0 s step); while the trainer waits for a batch (its first step), its
    own do. :meth:`poll`, called at a process's natural breaks, sets ``own + lent`` threads
    while ``idle()`` says the other side waits and ``own`` while it works. The trainer polls
    between the layers of its passes (forward and backward), before each optimizer step and
    after asking the engine for a batch; the engine between the layers of its passes and
    before each decode step.

    Only the thread count changes, never the arithmetic's order, on kernels whose results do
    not depend on it: measured bit for bit on this machine type
    (``tests/trainer/test_async_rollout.py``; ``scripts/thread_invariance.py`` checks a model
    on a machine), but not promised by torch for every kernel and CPU, which is why it is off
    by default."""

    def __init__(self, own: int, lent: int, idle: Callable[[], bool]) -> None:
        self.own, self.lent, self.idle = own, lent, idle
        self.current = own
        self.since = time.perf_counter()
        self.lent_s = 0.0  # seconds on own + lent threads since the last take_lent_s

    def poll(self) -> None:
        want = self.own + self.lent if self.idle() else self.own
        if want != self.current:
            self._account()
            torch.set_num_threads(want)
            self.current = want

    def _account(self) -> None:
        now = time.perf_counter()
        if self.current != self.own:
            self.lent_s += now - self.since
        self.since = now

    def take_lent_s(self) -> float:
        """Seconds this process ran on the lent threads since the last call."""
        self._account()
        out, self.lent_s = self.lent_s, 0.0
        return out

    def restore(self) -> None:
        """Back to this process's own threads."""
        self._account()
        torch.set_num_threads(self.own)
        self.current = self.own


class AsyncEngine:
    """The engine process and its weight slots (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, engine: str,
                 opts: EngineOptions, steps_ahead: int, threads: int, recompute: Recompute,
                 version: int = 0, startup_timeout_s: float = 600.0,
                 device: torch.device | None = None, turns: Any = None,
                 whole_publish: bool = False, lend_threads: bool = False) -> None:
        """``whole_publish``: copy the whole policy at every publish, also for a LoRA policy
        (to measure what publishing only the adapter saves). ``lend_threads``: the engine
        process also runs on this process's threads while :meth:`take` waits
        (:class:`ThreadLending`)."""
        self.entries, sizes = _layout(model)
        self._unique = distinct(self.entries)  # tied tensors are copied once
        self._changing = None if whole_publish else changing(model, self._unique)
        self.slots = [{k: torch.empty(n, dtype=getattr(torch, k)).share_memory_()
                       for k, n in sizes.items()} for _ in range(steps_ahead + 1)]
        self._filled = [False] * len(self.slots)  # holds the whole policy of some version
        self.slot_versions = torch.full((len(self.slots),), -1, dtype=torch.long).share_memory_()
        self.bytes_per_slot = sum(t.numel() * t.element_size() for t in self.slots[0].values())
        self.last_publish_bytes = 0
        self.threads = threads
        # requests asked for / finished by the engine process (it counts them in shared memory)
        self.submitted, self.finished = 0, torch.zeros(1, dtype=torch.long).share_memory_()
        # 1 while take() waits, with thread lending (the engine then borrows our threads)
        self.waiting = (torch.zeros(1, dtype=torch.long).share_memory_() if lend_threads
                        else None)
        self.publish(model, version)
        ctx = mp.get_context("spawn")  # fork would copy this process's threads and locks
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=_engine_main, daemon=True, name="gspo-rollout-engine",
            args=(_skeleton(model), self.entries, self.slots, self.slot_versions, tokenizer,
                  engine, opts, threads, recompute, self.requests, self.results,
                  device if device is not None else torch.device("cpu"), turns,
                  self._changing, self.finished, self.waiting, torch.get_num_threads()))
        self.proc.start()
        # Only the engine process writes batches: the trainer's copy of that end of the pipe
        # closed, the engine's death ends a batch it was writing (a full pipe holds a
        # finished batch half-written until take() reads it) in an end of file, where this
        # process's own open copy would have kept take() waiting for the rest forever.
        self.results._writer.close()
        # At exit, before multiprocessing's own handler ends daemon processes with a SIGTERM
        # (which this one ignores) and joins them: a trainer that never called close()
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        try:
            kind, payload = self._get(startup_timeout_s)
        except BaseException:  # e.g. a Ctrl-C while it starts (vLLM takes minutes): stop it
            self.proc.kill()  # now; this object is gone before the exit, whose join of a
            self.close()  # process that ignores SIGTERM would wait for it forever
            raise
        if kind != "ready":
            self.close()
            raise RuntimeError(f"rollout engine process did not start: {payload}")

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> float:
        """Copy ``model``'s weights into version ``version``'s slot (after its first fill, only
        the tensors that can change); the seconds it took."""
        start = time.perf_counter()
        slot = version % len(self.slots)
        self.slot_versions[slot] = -1  # a batch that reads it now fails its check
        only = self._changing if self._filled[slot] else None  # None: the whole policy
        fill_slot(self.slots[slot], self.entries, self._unique, model, only=only)
        self._filled[slot] = True
        self.last_publish_bytes = entry_bytes(self.entries, self._unique if only is None
                                              else only)
        self.slot_versions[slot] = version
        return time.perf_counter() - start

    def published(self) -> None:
        """Nothing to wait for: :meth:`publish` returns once the slot holds the version."""

    def submit(self, req: Request) -> None:
        self.submitted += 1
        self.requests.put(req)

    def idle(self) -> bool:
        """Whether the engine process has finished every request asked of it so far (it then
        waits for the next, and its ``threads`` cores are free)."""
        return int(self.finished) == self.submitted

    def take(self, timeout_s: float = 3600.0) -> tuple[int, dict[str, Any]]:
        """The next finished batch, in submission order: (step, encoded rollout)."""
        if self.waiting is not None:
            self.waiting.fill_(1)
        try:
            kind, payload = self._get(timeout_s)
        finally:
            if self.waiting is not None:
                self.waiting.fill_(0)
        if kind != "batch":
            raise RuntimeError(f"rollout engine process failed:\n{payload}")
        return payload

    def _get(self, timeout_s: float) -> tuple[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            try:
                return self.results.get(timeout=POLL_S)
            except (EOFError, OSError):  # the engine died, maybe in the middle of a batch
                self.proc.join(timeout=POLL_S)
                raise RuntimeError(f"rollout engine process died (exit code "
                                   f"{self.proc.exitcode})") from None
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"rollout engine process died (exit code "
                                       f"{self.proc.exitcode})") from None
                if time.monotonic() > end:
                    raise TimeoutError(f"no batch from the rollout engine in {timeout_s:.0f} s"
                                       ) from None

    def close(self) -> None:
        if hasattr(self, "_at_exit"):  # absent when the process did not start
            atexit.unregister(self._at_exit)
        if self.proc.is_alive():
            self.requests.put(None)
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        for q in (self.requests, self.results):
            q.close()
            q.cancel_join_thread()


def _close_at_exit(engine: weakref.ref[AsyncEngine]) -> None:
    if (alive := engine()) is not None:
        alive.close()
