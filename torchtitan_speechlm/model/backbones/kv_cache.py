"""The KV cache of the backbones built from torchtitan's blocks (``native``: llama3 blocks;
``qwen3``: qwen3 blocks, dense and MoE), and the step through those blocks that fills and reads it.

Why a module of its own: torchtitan's ``Attention.forward`` takes no cache (it attends over the
positions it is given), so generation with these backbones recomputed the whole prefix every
frame (O(T^2)). Both backbones share this one step, with the blocks' own weights; the ``hf``
backbone uses transformers' ``DynamicCache`` instead.

The cache (``StaticKVCache``) holds, per layer, keys and values [B, kv heads, capacity,
head_dim], allocated once and written in place (``index_copy_``), the capacity doubled when a
step would pass it, and a [B, capacity] boolean of the real (non left-padding) slots. A step
(``forward_step``) is torchtitan's ``TransformerBlock.forward`` with its attention done here:
``wq``/``wk``/``wv`` (then qwen3's q/k norms), RoPE by torchtitan's own ``apply_rotary_emb`` of
the family at ``position_ids``, the new keys / values written at their slots, SDPA over the
cache with a boolean mask (causal, no padding slot; grouped-query attention by SDPA's
``enable_gqa``) and ``wo``; then the feed-forward (or MoE) as torchtitan's block does. Each
query also sees its own slot, so a padding query gets a finite output (never read) rather
than a NaN that 0 x NaN would carry into the real rows of the next layer.

Tensor parallelism: the number of heads is read from ``wk``'s output, so a colwise-sharded
``wk`` (torchtitan's TP plan shards heads) gives a cache of the local heads. torchtitan's plan
for these blocks is sequence-parallel, though (the native decoder splits every row along the
sequence across the TP ranks, ``NativeDecoder._split``), and a one-frame step cannot be split
that way, so ``decode`` refuses a tensor-parallel module (NotImplementedError naming this;
generation then recomputes each row in full through ``run``, which does run under TP).

``compile_decode`` runs the one-frame steps (the prefill stays eager) under ``torch.compile``
with static shapes (``dynamic=False``): the step then attends over the whole capacity (slots
past the current length are masked), so every step of the same batch size and capacity is one
graph; a doubling or a batch of another size compiles once more. If compiling fails the step
runs eagerly from then on, after a one-line warning.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_speechlm.utils.upstream import logger

MIN_CAPACITY = 256  # slots allocated at the first call (at least; a power of two)

Rotary = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (xq, xk, table, positions)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class StaticKVCache:
    """Per layer ``keys[i]`` / ``values[i]`` [B, kv heads, capacity, head_dim] (None until the
    first call writes them), ``real`` [B, capacity] (True: a slot of the rows' real frames) and
    ``length``, the slots filled so far (the same for every row: rows are left-padded)."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    real: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, layers: int, batch: int, capacity: int, device) -> StaticKVCache:
        real = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        return cls([None] * layers, [None] * layers, real)

    @property
    def capacity(self) -> int:
        return self.real.shape[1]

    @property
    def batch_size(self) -> int:
        return self.real.shape[0]

    def reserve(self, total: int) -> None:
        """Room for ``total`` slots: the capacity doubled until it holds them (the filled
        slots copied into the new buffers)."""
        if total <= self.capacity:
            return
        capacity = self.capacity
        while capacity < total:
            capacity *= 2
        self.keys = [_grown(k, capacity, self.length) for k in self.keys]
        self.values = [_grown(v, capacity, self.length) for v in self.values]
        real = self.real.new_zeros(self.batch_size, capacity)
        real[:, : self.length] = self.real[:, : self.length]
        self.real = real

    def select_rows(self, index: torch.Tensor) -> StaticKVCache:
        """A new cache of the batch rows ``index`` only, in that order (copies)."""
        index = index.to(self.real.device)

        def pick(t):
            return None if t is None else t.index_select(0, index)

        return StaticKVCache(
            [pick(k) for k in self.keys],
            [pick(v) for v in self.values],
            pick(self.real),
            self.length,
        )

    def without_first(self, n: int) -> StaticKVCache:
        """This cache without its first ``n`` slots (padding in every row: a continuous batch
        whose oldest rows have left), the rest moved to the front, in place."""
        if n <= 0:
            return self
        keep = self.length - n
        for t in self.keys + self.values:
            t[:, :, :keep] = t[:, :, n : self.length].clone()
        self.real[:, :keep] = self.real[:, n : self.length].clone()
        self.real[:, keep:] = False
        self.length = keep
        return self

    def joined(self, other: StaticKVCache) -> StaticKVCache:
        """A new cache of this one's rows, then ``other``'s (requests that join a batch in
        progress: serving/batcher.py): the shorter one's slots moved right so that both end at
        the same slot, as left padding (not real; each key keeps its RoPE position, which is
        its row's position and not its slot)."""
        if len(self.keys) != len(other.keys) or any(k is None for k in self.keys + other.keys):
            raise ValueError("joined: both caches must be filled, with the same layers")
        length = max(self.length, other.length)
        capacity = _pow2(max(self.capacity, other.capacity, length))

        def cat(a: torch.Tensor, b: torch.Tensor, la: int, lb: int) -> torch.Tensor:
            out = a.new_zeros(a.shape[0] + b.shape[0], *a.shape[1:2], capacity, *a.shape[3:])
            out[: a.shape[0], ..., length - la : length, :] = a[..., :la, :]
            out[a.shape[0] :, ..., length - lb : length, :] = b[..., :lb, :]
            return out

        real = self.real.new_zeros(self.batch_size + other.batch_size, capacity)
        real[: self.batch_size, length - self.length : length] = self.real[:, : self.length]
        real[self.batch_size :, length - other.length : length] = other.real[:, : other.length]
        return StaticKVCache(
            [
                cat(a, b, self.length, other.length)
                for a, b in zip(self.keys, other.keys, strict=True)
            ],
            [
                cat(a, b, self.length, other.length)
                for a, b in zip(self.values, other.values, strict=True)
            ],
            real,
            length,
        )


def _grown(t: torch.Tensor | None, capacity: int, filled: int) -> torch.Tensor | None:
    if t is None:
        return None
    out = t.new_zeros(*t.shape[:2], capacity, *t.shape[3:])
    out[:, :, :filled] = t[:, :, :filled]
    return out


def attend(
    attn: nn.Module,
    x: torch.Tensor,
    rotary: Rotary,
    table: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    keys: list,
    values: list,
    i: int,
    capacity: int,
) -> torch.Tensor:
    """torchtitan's ``Attention.forward`` (llama3 or qwen3) over the cache of layer ``i``: the
    new keys / values written at ``slots``, the queries attending where ``visible`` [B, 1, t,
    window] says (the first ``window`` slots)."""
    b, t, _ = x.shape
    d = attn.head_dim
    q = attn.wq(x).view(b, t, -1, d)
    k = attn.wk(x).view(b, t, -1, d)  # -1: the local heads under a colwise shard
    v = attn.wv(x).view(b, t, -1, d)
    if getattr(attn, "q_norm", None) is not None:  # qwen3
        q = attn.q_norm(q)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    q, k = rotary(q, k, table, positions)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if keys[i] is None:  # the first call: allocate (its head count is wk's)
        shape = (b, k.shape[1], capacity, d)
        keys[i], values[i] = k.new_zeros(shape), v.new_zeros(shape)
    keys[i].index_copy_(2, slots, k)
    values[i].index_copy_(2, slots, v)
    window = visible.shape[-1]
    out = F.scaled_dot_product_attention(
        q,
        keys[i][:, :, :window],
        values[i][:, :, :window],
        attn_mask=visible,
        scale=getattr(attn, "scaling", None),  # qwen3's head_dim ** -0.5 (the default too)
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return attn.wo(out.transpose(1, 2).reshape(b, t, -1))


def forward_step(
    module: nn.Module,
    h: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    real: torch.Tensor,
    window: int,
    keys: list,
    values: list,
    rotary: Rotary,
    table: torch.Tensor,
) -> torch.Tensor:
    """The decoder's blocks (``module.layers``) and final norm over the new positions ``h``
    [B, t, D], written at ``slots`` [t] of the cache (``real`` [B, capacity]: its real slots);
    the queries attend over the first ``window`` slots (the length after this step, or the
    whole capacity: the same, masked, and one shape for every step)."""
    capacity = real.shape[1]
    real = real[:, :window]
    k = torch.arange(window, device=real.device)
    causal = k[None, :] <= slots[:, None]  # [t, window]
    own = k[None, :] == slots[:, None]
    visible = ((real[:, None, :] & causal[None]) | own[None])[:, None]  # [B, 1, t, window]
    for i, layer in enumerate(module.layers.values()):
        h = h + attend(
            layer.attention,
            layer.attention_norm(h),
            rotary,
            table,
            positions,
            slots,
            visible,
            keys,
            values,
            i,
            capacity,
        )
        ffn = layer.moe if getattr(layer, "moe_enabled", False) else layer.feed_forward
        h = h + ffn(layer.ffn_norm(h))
    return h if module.norm is None else module.norm(h)


# decoder module -> its compiled one-frame step (compile_decode), the one in use
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (torch.compile mode) -> the compiled step: switching modes reuses what was compiled
_BY_MODE: dict[str, Callable] = {}


def compile_decode(module: nn.Module, on: bool, mode: str = "default") -> bool:
    """Run ``module``'s one-frame decode steps under ``torch.compile`` (static shapes; ``mode``
    torch.compile's: ``"reduce-overhead"`` replays the step as a CUDA graph) or eagerly; True
    when they are compiled."""
    if not on:
        _COMPILED.pop(module, None)
    else:
        if mode not in _BY_MODE:
            _BY_MODE[mode] = torch.compile(forward_step, dynamic=False, mode=mode)
        _COMPILED[module] = _BY_MODE[mode]
    return module in _COMPILED


class StaticCacheDecoding:
    """A ``Backbone`` mixin for decoders of torchtitan blocks: ``decode`` through this module's
    static cache, ``select_rows`` and ``compile_decode``. The family says how its blocks apply
    RoPE (``rotary``: torchtitan's function of that model and the module's table)."""

    def rotary(self, module: nn.Module) -> tuple[Rotary, torch.Tensor]:
        raise NotImplementedError

    def decode(self, module, inputs_embeds, position_ids, attention_mask, cache):
        return decode(
            module, inputs_embeds, position_ids, attention_mask, cache, *self.rotary(module)
        )

    def select_rows(self, cache, index):
        return cache.select_rows(index)

    def can_join(self, cache) -> bool:
        return isinstance(cache, StaticKVCache) and all(k is not None for k in cache.keys)

    def join_rows(self, cache, other):
        return cache.joined(other)

    def drop_first_slots(self, cache, n: int):
        return cache.without_first(n)

    def compile_decode(self, module, on: bool, mode: str = "default") -> bool:
        return compile_decode(module, on, mode)


def decode(
    module: nn.Module,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: StaticKVCache | None,
    rotary: Rotary,
    table: torch.Tensor,
) -> tuple[torch.Tensor, StaticKVCache]:
    """``Backbone.decode`` for a decoder of torchtitan blocks: hidden states of the new
    positions and the cache (created on the first call, ``cache=None``)."""
    if getattr(module, "tp_mesh", None) is not None:
        raise NotImplementedError(
            "KV-cache decoding under tensor parallelism: torchtitan's TP plan for these blocks "
            "is sequence-parallel (each row split along the sequence across the TP ranks), "
            "which a one-frame step cannot be; decode on one device, or recompute in full"
        )
    b, t, _ = inputs_embeds.shape
    if cache is None:
        cache = StaticKVCache.empty(
            len(module.layers), b, _pow2(max(MIN_CAPACITY, t)), inputs_embeds.device
        )
    past = cache.length
    if tuple(attention_mask.shape) != (b, past + t) or cache.batch_size != b:
        raise ValueError(
            f"decode: attention_mask {tuple(attention_mask.shape)} for {b} rows of {t} new "
            f"frames after {past} cached ones (a cache of {cache.batch_size} rows): expected "
            f"({b}, {past + t})"
        )
    cache.reserve(past + t)
    cache.real[:, : past + t] = attention_mask.to(torch.bool)
    slots = torch.arange(past, past + t, device=inputs_embeds.device)
    args = (inputs_embeds, position_ids, slots)
    compiled = _COMPILED.get(module) if t == 1 and cache.keys[0] is not None else None
    hidden = None
    if compiled is not None:  # static shapes: attend over the whole capacity
        # fresh row-major inputs: a slice's strides (positions cut from a growing mask) would
        # differ every step and recompile
        fixed = [x.clone(memory_format=torch.contiguous_format) for x in args]
        try:
            hidden = compiled(
                module, *fixed, cache.real, cache.capacity, cache.keys, cache.values, rotary, table
            )
        except Exception as e:  # noqa: BLE001  (any compiler failure: run eagerly instead)
            _COMPILED.pop(module, None)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            logger.warning(
                f"decode: torch.compile of the one-frame step failed ({type(e).__name__}: "
                f"{first[:200]}); decoding eagerly"
            )
    if hidden is None:
        hidden = forward_step(
            module, *args, cache.real, past + t, cache.keys, cache.values, rotary, table
        )
    cache.length = past + t
    return hidden, cache
