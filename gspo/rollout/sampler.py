"""A KV-cached sampler that returns the policy's own fp32 log-probs.

Differences from ``model.generate`` that matter for RL:
- each prompt is prefilled once and its KV cache shared by its G samples;
- rows that emitted EOS leave the decode batch, so late steps run on the unfinished rows only;
- the log-prob of each sampled token is log_softmax(logits / temperature) in fp32, i.e. the
  policy's, not the top-k/top-p-processed distribution (equal when top_k=0 and top_p=1);
- tokens are drawn by inverse CDF (one uniform per row and step, drawn up front), not
  ``torch.multinomial``, so the same seed gives different samples than ``model.generate``
  (same distribution);
- the KV cache has room reserved for the new tokens instead of growing by concatenation;
- with ``fast_decode`` (Llama-family models, MoE siblings included), decode steps run through
  :class:`gspo.models.decode.DenseDecoder`, and the prefill through
  :func:`gspo.models.lean_forward.lean_hidden`: the same arithmetic as ``forward`` without its
  per-call overhead.

With ``record_routing=True`` (MoE policies, routing replay R3) the experts every router chose
for every token fed through the model are recorded and returned in ``Rollout.routing``, laid out
like the trainer's teacher-forced forward over ``pad_batch`` (see :class:`_RoutingLog`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

from gspo.models.decode import DenseDecoder, packable, packing_pays, unsupported
from gspo.models.lean_forward import (
    at_boundary,
    inference_safe,
    key_bias,
    lean_hidden,
    no_autograd,
)
from gspo.models.moe import capture_routing, router_modules
from gspo.models.onednn import linear as onednn_linear
from gspo.rollout.batch import Rollout


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling distribution's logits after top-k / top-p (unchanged when both are off)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > top_p  # keep the token that crosses p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF in :func:`_draw`


def _draw(probs: torch.Tensor, u: torch.Tensor, block: int = _BLOCK) -> torch.Tensor:
    """One token per row from ``probs`` [n, V] (unnormalised is fine) at uniforms ``u`` [n].

    Inverse CDF in two levels: the fp64 masses of blocks of ``block`` entries pick a block, then
    the fp64 running sum inside that block picks the token. Exact like a full fp64 ``cumsum``
    over V (which took ~16 ms a step at V = 49k, more than the sampling's other work), and one
    uniform per row instead of ``torch.multinomial``'s exponential draw per vocabulary entry.
    Never lands on a zero-probability token: each search returns the first entry whose
    cumulative mass exceeds a target strictly below the total.
    """
    n, v = probs.shape
    if v <= 4 * block:  # small vocabulary: one fp64 running sum is cheaper than two levels
        cdf = probs.cumsum(-1, dtype=torch.float64)
        total = cdf[:, -1:]
        target = torch.minimum(u.view(n, 1) * total, total * (1 - 2.0 ** -52))
        return torch.searchsorted(cdf, target, right=True).squeeze(-1)
    nb = -(-v // block)
    if nb * block != v:
        probs = torch.nn.functional.pad(probs, (0, nb * block - v))
    blocks = probs.view(n, nb, block)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [n, nb]
    total = cdf[:, -1:]
    target = torch.minimum(u.view(n, 1) * total, total * (1 - 2.0 ** -52))
    blk = torch.searchsorted(cdf, target, right=True)  # cdf[blk - 1] <= target < cdf[blk]
    before = torch.where(blk > 0, cdf.gather(-1, (blk - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(n, device=probs.device), blk.squeeze(-1)].cumsum(
        -1, dtype=torch.float64)  # [n, block]
    frac = (target - before) / (cdf.gather(-1, blk) - before)
    r = torch.minimum(frac * inner[:, -1:], inner[:, -1:] * (1 - 2.0 ** -52))
    j = torch.searchsorted(inner, r, right=True).squeeze(-1)
    return blk.squeeze(-1) * block + j


def _uniforms(n: int, group_size: int, steps: int,
              generator: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    """[n, steps] fp64 uniforms, drawn up front: row r uses ``u[r, step]``. With one generator
    per prompt, group p's rows come from generator p alone, so a row's samples depend neither on
    the other prompts in the batch nor on when the other rows finish (up to the logits' own
    dependence on the batch's padding: ~1e-7 in fp32, ~4e-3 in bf16, see
    :meth:`gspo.rollout.engine.RolloutEngine.generate`)."""
    if isinstance(generator, list):
        return torch.cat([torch.rand((group_size, steps), dtype=torch.float64, generator=g)
                          for g in generator])
    return torch.rand((n, steps), dtype=torch.float64, generator=generator)


def _next_tokens(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [n], its fp32 log-prob under log_softmax(logits / temperature) [n]); greedy when
    ``u`` is None, else drawn at the uniforms ``u`` [n]. Divides fp32 ``logits`` in place
    (the decode loop's own tensor: at SmolLM2's vocabulary a fresh [16, 49k] buffer per step
    cost 7 ms a step, page faults, where glibc returns freed memory to the system)."""
    scaled = logits.float()
    # greedy too: the argmax does not move, and its log-prob is the one the docstring names
    # (and the trainer's pass at this temperature computes); greedy at T = 0 keeps T = 1's
    if params.temperature != 1.0 and (u is not None or params.temperature > 0):
        scaled = scaled.div_(params.temperature)
    # logits − logsumexp, as the trainer computes it (gspo.models.logprobs): on CPU
    # torch.log_softmax's normaliser runs ~1e-5 low on 49k-way logits (measured), a bias
    # that would show up in every GSPO sequence ratio.
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    if u is None:
        tok = scaled.argmax(-1)
    elif params.top_k == 0 and params.top_p >= 1.0:
        tok = _draw(torch.sub(scaled, lse).exp_(), u)  # the policy's own distribution
    else:
        tok = _draw(torch.softmax(_filter(scaled, params.top_k, params.top_p), -1), u)
    return tok, (scaled.gather(-1, tok[:, None]) - lse).squeeze(-1)


class _ReservedLayer(DynamicLayer):
    """A KV-cache layer with room reserved for the tokens still to come.

    ``DynamicLayer.update`` concatenates, copying the whole cache of every layer at every decode
    step, which grows with the square of the response length; this one writes each step's keys
    and values into a buffer allocated once and hands out views of its filled part, which hold
    the same numbers. (At 32 new tokens on SmolLM2 the two measured the same speed.)
    """

    def __init__(self, layer: DynamicLayer, extra: int) -> None:
        super().__init__()
        self.lazy_initialization(layer.keys, layer.values)
        b, h, n, d = layer.keys.shape
        self._k = layer.keys.new_empty((b, h, n + extra, d))
        self._v = layer.values.new_empty((b, h, n + extra, layer.values.shape[-1]))
        self._k[:, :, :n], self._v[:, :, :n] = layer.keys, layer.values
        self._n = n
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self._n], self._v[:, :, :self._n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._n + key_states.shape[-2]
        if end > self._k.shape[2]:  # more than reserved: grow like DynamicLayer
            self._k = torch.cat([self._k[:, :, :self._n], key_states], dim=-2)
            self._v = torch.cat([self._v[:, :, :self._n], value_states], dim=-2)
        else:
            self._k[:, :, self._n:end], self._v[:, :, self._n:end] = key_states, value_states
        self._n = end
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self._views()


def _reserve(cache: Any, extra: int) -> None:
    """Swap the plain dynamic layers of ``cache`` for :class:`_ReservedLayer` (others, e.g.
    sliding-window layers, are left as they are)."""
    layers = getattr(cache, "layers", [])
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4:
            layers[i] = _ReservedLayer(layer, extra)


class _RoutingLog:
    """Expert choices of one sampling call, written into the trainer's padded layout.

    ``pad_batch`` right-pads ``prompt + response`` of row ``i``, so the token at position ``t`` of
    that sequence sits at ``(i, t)``: prompt token ``t`` at ``t``, response token ``s`` at
    ``len(prompt) + s``. Every router call is read right after its forward (one ``[rows * width,
    k]`` chunk per MoE layer) and scattered to those positions: the left-padded prefill of each
    prompt is copied to its ``G`` rows, and decode step ``s`` feeds response token ``s`` of the
    still-active rows. Positions never fed through the model stay ``-1`` (unknown): padding and
    the final sampled token of every row (sampling stops before it is fed; its routing does not
    enter any response log-prob, which are the logits at the positions before it).
    """

    def __init__(self, model: Any, prompt_lens: list[int], group_size: int, steps: int) -> None:
        self._ctx = capture_routing(model, device="cpu")
        self._rec = self._ctx.__enter__()
        k = {int(getattr(r, "top_k", 0)) for r in router_modules(model)}
        if len(k) != 1:
            self.close()
            raise ValueError(f"record_routing: routers disagree on top_k ({sorted(k)})")
        self.k = k.pop()
        self.prompt_lens = torch.tensor(prompt_lens, dtype=torch.long).repeat_interleave(
            group_size)
        self.group_size = group_size
        n, width = len(self.prompt_lens), max(prompt_lens) + steps
        self.buf = torch.full((self._rec.num_layers, n, width, self.k), -1, dtype=torch.long)

    def prefill(self, width: int) -> None:
        """Prompt tokens of the left-padded ``[P, width]`` prefill, copied to each group row."""
        chunk = torch.stack(self._rec.take()).view(self.buf.shape[0], -1, width, self.k)
        for p in range(chunk.shape[1]):
            n_tok = int(self.prompt_lens[p * self.group_size])
            rows = slice(p * self.group_size, (p + 1) * self.group_size)
            self.buf[:, rows, :n_tok] = chunk[:, p:p + 1, width - n_tok:]

    def decode(self, step: int, active: torch.Tensor) -> None:
        """Response token ``step`` of the ``active`` rows, fed one per row."""
        chunk = torch.stack(self._rec.take())  # [L, len(active), k]
        active = active.cpu()  # the log lives on the CPU, as the routing capture does
        self.buf[:, active, self.prompt_lens[active] + step] = chunk

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def layout(self, response_lens: list[int]) -> list[torch.Tensor]:
        """Per MoE layer ``[n * T, k]``, ``T`` as in ``pad_batch`` (-1 = unknown)."""
        width = int(max(int(p) + r for p, r in zip(self.prompt_lens, response_lens)))
        return [b[:, :width].reshape(-1, self.k) for b in self.buf]


@torch.no_grad()
def generate(model: Any, prompts: list[list[int]], *, group_size: int, params: SamplingParams,
             eos: list[int], pad_id: int,
             generator: torch.Generator | list[torch.Generator] | None = None,
             greedy: bool = False, record_routing: bool = False,
             fast_decode: bool = True, decode_matmul: str = "auto") -> Rollout:
    """Sample ``group_size`` responses for each prompt; rows of a group are contiguous.

    ``generator`` may be a list with one generator per prompt: each group then draws from its
    own, so its samples do not depend on which other prompts share the batch.

    ``record_routing`` (supported MoE models only) fills ``Rollout.routing`` with the experts the
    routers chose while sampling, in ``pad_batch`` layout (see :class:`_RoutingLog`); off, no hook
    is registered and nothing is recorded.

    ``fast_decode`` runs the prefill through :func:`gspo.models.lean_forward.lean_hidden` and
    the decode steps through :class:`gspo.models.decode.DenseDecoder` when the model is one
    they cover (an MoE model's blocks run as its own modules there, so routing is recorded
    alike); else both through ``forward``.
    ``decode_matmul`` picks the decode steps' matrix products (:class:`DenseDecoder`'s
    ``packed``): "blas" (``F.linear``), "onednn" (packed weights; a CPU model in float32, or
    in bfloat16 where oneDNN has bf16 kernels), "auto"
    (onednn where :func:`gspo.models.decode.packable` allows and
    :func:`gspo.models.decode.packing_pays`: layers larger than the tiny presets').
    """
    if decode_matmul not in ("auto", "blas", "onednn"):
        raise ValueError(f"decode_matmul: {decode_matmul!r} is not one of auto, blas, onednn")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:  # its first token would be drawn from a padding position's logits
        raise ValueError(f"generate: prompt {empty[0]} has no tokens")
    was_training = model.training
    model.eval()
    dev = model.get_input_embeddings().weight.device  # everything below is built there
    ids, mask = (t.to(dev) for t in _left_pad(prompts, pad_id))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # decided before the routing log hooks the routers (the lean passes call an MoE block as
    # its own module, so those hooks fire there too; hooks elsewhere would be bypassed)
    lean = fast_decode and unsupported(model) is None
    if (why := onednn_refusal(model, decode_matmul, fast_decode)) is not None:
        raise ValueError(f"decode_matmul=onednn: {why}")
    log = (_RoutingLog(model, [len(p) for p in prompts], group_size, params.max_new_tokens)
           if record_routing else None)
    try:
        packed = lean and (decode_matmul == "onednn" or (
            decode_matmul == "auto" and packable(model, bf16=True) is None
            and packing_pays(model)))
        # The fast path runs in inference mode (no autograd bookkeeping on any tensor: a tiny
        # model's decode step 0.81 -> 0.67 ms); what it returns is copied out of it below.
        with no_autograd(lean and inference_safe(model)):
            roll = _generate(model, prompts, ids, mask, positions, group_size, params, eos,
                             generator, greedy, log, lean, packed)
    finally:
        if log is not None:
            log.close()
        model.train(was_training)
    roll.logprobs = [lp.clone() for lp in roll.logprobs]  # own storage, normal tensors
    if log is not None:
        roll.routing = log.layout([len(r) for r in roll.response_ids])
    return roll


def onednn_refusal(model: Any, decode_matmul: str, fast_decode: bool = True) -> str | None:
    """Why ``decode_matmul="onednn"`` cannot run ``model``'s decode steps (None: it can, or
    another choice was made, or the steps run through ``forward``, which packs nothing)."""
    if decode_matmul != "onednn" or not fast_decode or unsupported(model) is not None:
        return None
    return packable(model, bf16=True)


def _lean_prefill(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                  onednn: bool = False) -> tuple[DynamicCache, torch.Tensor]:
    """The prefill through :func:`gspo.models.lean_forward.lean_hidden`: its keys and values
    as a dynamic cache, and the last position's logits (what ``forward`` returns with
    ``logits_to_keep=1``). ``onednn``: its layers' products through oneDNN
    (:func:`gspo.models.onednn.linear`), as the packed decode steps that follow."""
    hidden, kv = lean_hidden(model.model, ids, positions,
                             key_bias(mask, ids.shape[1], model.lm_head.weight.dtype),
                             keep_kv=True, linear=onednn_linear if onednn else F.linear)
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    head = model.lm_head
    return cache, torch.nn.functional.linear(hidden[:, -1], head.weight, head.bias)


def _generate(model: Any, prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor,
              positions: torch.Tensor, group_size: int, params: SamplingParams, eos: list[int],
              generator: torch.Generator | list[torch.Generator] | None, greedy: bool,
              log: _RoutingLog | None, lean: bool, packed: bool = False) -> Rollout:
    if lean:
        cache, logits = _lean_prefill(model, ids, mask, positions, onednn=packed)
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
        cache, logits = out.cache, out.logits[:, -1]
    if log is not None:
        log.prefill(ids.shape[1])
    if group_size > 1:  # one prefill per prompt, shared by the group
        cache.batch_repeat_interleave(group_size)
        logits = logits.repeat_interleave(group_size, 0)
        mask = mask.repeat_interleave(group_size, 0)
    n, steps = logits.shape[0], params.max_new_tokens
    _reserve(cache, steps)
    decoder = DenseDecoder(model, cache, mask, steps, packed=packed) if lean else None
    dev = ids.device
    # drawn on the CPU generators (the same samples on any device), used where the logits are
    u = None if greedy else _uniforms(n, group_size, steps, generator).to(dev)
    next_pos = mask.sum(-1)
    active = torch.arange(n, device=dev)  # original index of each row still decoding
    # Rows of ``tok_rows`` / ``lp_rows`` (and ``u``) follow ``active``: each step writes one
    # column; a row's samples move to ``tokens`` / ``lps`` when it leaves the decode batch.
    tokens = torch.zeros((n, steps), dtype=torch.long, device=dev)
    lps = torch.zeros((n, steps), dtype=torch.float32, device=dev)
    tok_rows, lp_rows = torch.zeros_like(tokens), torch.zeros_like(lps)
    lengths = torch.full((n,), steps, dtype=torch.long, device=dev)  # set when a row ends early
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    eos_t = torch.tensor(eos, dtype=torch.long, device=dev)
    for step in range(steps):
        tok, tok_lp = _next_tokens(logits, params, None if u is None else u[:, step])
        tok_rows[:, step], lp_rows[:, step] = tok, tok_lp
        finished = tok == eos_t[0] if len(eos) == 1 else torch.isin(tok, eos_t)
        last = step == steps - 1
        if last or bool(finished.any()):
            ended = active[finished]
            done[ended], lengths[ended] = True, step + 1
            if last or bool(finished.all()):
                break
            tokens[ended], lps[ended] = tok_rows[finished], lp_rows[finished]
            # drop the finished rows from the decode batch and the KV cache
            keep = (~finished).nonzero().squeeze(-1)
            (cache if decoder is None else decoder).batch_select_indices(keep)
            active, tok, mask, next_pos = active[keep], tok[keep], mask[keep], next_pos[keep]
            tok_rows, lp_rows = tok_rows[keep], lp_rows[keep]
            u = None if u is None else u[keep]
        at_boundary()  # thread lending's poll (rollout.async_lend_threads), else nothing
        if decoder is not None:
            logits = decoder.step(tok, next_pos)
        else:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            out = model(input_ids=tok[:, None], attention_mask=mask,
                        position_ids=next_pos[:, None], cache=cache, use_cache=True)
            logits = out.logits[:, -1]
        if log is not None:
            log.decode(step, active)
        next_pos = next_pos + 1
    tokens[active], lps[active] = tok_rows, lp_rows
    rows = lengths.tolist()
    lps = lps.cpu()  # a Rollout lives on the CPU, whatever device sampled it (one copy)
    return Rollout(
        prompt_ids=[list(p) for p in prompts for _ in range(group_size)],
        response_ids=[t[:k] for t, k in zip(tokens.tolist(), rows)],
        logprobs=[lps[i, :k] for i, k in enumerate(rows)],
        truncated=[not d for d in done.tolist()],
        group_size=group_size,
    )


def greedy_generate(model: Any, prompts: list[list[int]], *, max_new_tokens: int, eos: list[int],
                    pad_id: int, fast_decode: bool = True, decode_matmul: str = "auto"
                    ) -> list[list[int]]:
    """Greedy responses (evaluation)."""
    roll = generate(model, prompts, group_size=1, params=SamplingParams(max_new_tokens),
                    eos=eos, pad_id=pad_id, greedy=True, fast_decode=fast_decode,
                    decode_matmul=decode_matmul)
    return roll.response_ids
