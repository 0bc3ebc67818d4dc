"""The key/value cache of a decoder, shaped like the ones serving engines use, and the masks of its decode steps.

:class:`KVCache` holds, per layer, one preallocated key buffer and one value buffer (B, H_kv, slots, E) and the
number of slots in use. A call writes its new keys and values into the next free slots (``buffer[:, :, n:n+L] =
...``, no ``torch.cat``) and attends to the view ``buffer[:, :, :n+L]``. The buffers are sized once when
``max_len`` is given (a static cache: a call that would go past it is refused), else they grow by doubling
(amortised O(1) copies per token).

What is stored depends on the cache:

- **full** and **window-only** caches store keys *after* the rotary rotation, at their position in the text,
  as vLLM and Hugging Face's static cache do: a key is rotated once, when it is written, and never again;
- a cache with **sinks** (StreamingLLM, Xiao et al., 2023) stores keys *before* the rotation and rotates every
  cached key by its slot at every step. It must: when an old token is evicted, every token after the sinks
  moves one slot towards them, so its position inside the cache changes and its key must be rotated to the new
  position (StreamingLLM assigns positions within the cache, never positions in the text).

A rolling cache (``window=W``) keeps the ``W - 1`` most recent tokens (plus the ``sinks`` first ones) between
calls: the next query brings its own key and sees exactly W. Eviction moves the kept tokens to the front of the
buffer in place (the buffer never grows past ``sinks + W - 1`` plus one call's tokens).

A full cache may also roll some layers only (``layer_windows``, one window or ``None`` per layer: the local
layers of a model that interleaves sliding-window and global layers, as Gemma 2 and 3 do). Such a layer keeps its
``W - 1`` most recent tokens, the others every token: :meth:`KVCache.held` says how many a layer holds, and
``len(cache)`` is the most any layer holds.

**Left padding** (batched generation of prompts of different lengths): row ``b`` of the first call may start
with ``pad[b]`` padding tokens. Its positions start at its first real token (position ``t - pad[b]`` for text
index ``t``), and the key-padding mask keeps every query from reading a padding key. Each row then computes
what it would compute alone.

The masks come from the mask mods of :mod:`attention_core.mask_mods`: :func:`decode_mask_mod` composes the
bottom-right causal mask with a window (or sinks and a window) and the key padding with ``and_masks``; the dense
form (``mask_mods.dense_mask``) is built where SDPA needs a tensor.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch

from attention_core import mask_mods
from attention_core._checks import check_instance, check_int, check_positive_int, check_tensor
from attention_core.positional import RotaryEmbedding, _rotate, rotary_angles

__all__ = ["CacheSnapshot", "KVCache", "cached_causal_mask", "decode_mask", "decode_mask_mod", "left_padding",
           "rotate_at"]


# ------------------------------------------------------------------------------------------------ masks


def left_padding(pad: torch.Tensor) -> mask_mods.MaskMod:
    """Batch row ``b`` never reads its first ``pad[b]`` keys (left padding; :func:`mask_mods.key_padding` is the
    right-padding twin)."""
    pad = torch.as_tensor(pad, dtype=torch.long)
    if pad.dim() != 1 or bool((pad < 0).any()):
        raise ValueError(f"pad must be B counts >= 0, got {pad!r:.80}")

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx >= pad.to(kv_idx.device)[b]

    mask_mod.__name__ = mask_mod.__qualname__ = "left_padding"
    mask_mod.flex_kind = None
    return mask_mod


def _shifted(mod: mask_mods.MaskMod, offset: int) -> mask_mods.MaskMod:
    """``mod`` with query ``i`` read as position ``i + offset`` (an upper-left mod moved to bottom-right)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx + offset, kv_idx)

    mask_mod.__name__ = mask_mod.__qualname__ = f"shifted({getattr(mod, '__name__', 'mod')}, {offset})"
    mask_mod.flex_kind = None
    return mask_mod


def decode_mask_mod(L: int, S: int, window: Optional[int] = None, sinks: int = 0,
                    pad: Optional[torch.Tensor] = None) -> mask_mods.MaskMod:
    """The mask mod of L new queries over S keys whose last L are the queries' own.

    ``causal_bottom_right(L, S)``, and with ``window`` the window (``sliding_window``, or ``sinks_and_window`` when
    ``sinks``) moved bottom-right, and with ``pad`` the left padding, all joined by ``and_masks``.
    """
    L = check_positive_int(L, "L", allow_zero=True)
    S = check_positive_int(S, "S", allow_zero=True)
    if L > S:
        raise ValueError(f"L (queries) must be <= S (keys, which include the queries' own), got L={L}, S={S}")
    sinks = check_positive_int(sinks, "sinks", allow_zero=True)
    mods = [mask_mods.causal_bottom_right(L, S)]
    if window is not None:
        window = check_positive_int(window, "window")
        local = mask_mods.sinks_and_window(sinks, window) if sinks else mask_mods.sliding_window(window)
        mods.append(_shifted(local, S - L))
    if pad is not None:
        mods.append(left_padding(pad))
    return mods[0] if len(mods) == 1 else mask_mods.and_masks(*mods)


def decode_mask(L: int, S: int, window: Optional[int] = None, sinks: int = 0, pad: Optional[torch.Tensor] = None,
                *, device: Optional[torch.device] = None) -> torch.Tensor:
    """Dense bool form of :func:`decode_mask_mod`: (L, S), or (B, 1, L, S) with ``pad`` (True = attend)."""
    mod = decode_mask_mod(L, S, window, sinks, pad)
    if pad is None:
        return mask_mods.dense_mask(mod, 1, 1, L, S, device=device)[0, 0]  # (1, 1, L, S) -> (L, S)
    return mask_mods.dense_mask(mod, len(pad), 1, L, S, device=device)  # (B, 1, L, S)


def cached_causal_mask(
    L: int, S: int, window: Optional[int] = None, sinks: int = 0, *, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Bool (L, S) mask for L new queries attending to S keys whose last L are the queries' own.

    Aligned bottom-right: query ``i`` sits at key slot ``S - L + i`` and sees keys ``j <= S - L + i``. With
    ``window``, only the ``window`` most recent of those (itself included) and, with ``sinks``, also the first
    ``sinks`` keys. For ``L == S`` and no window this is :func:`attention_core.causal_mask`. A thin wrapper of
    :func:`decode_mask` (the mask mods).

    Args:
        L: number of queries (new tokens), ``L <= S``.
        S: number of keys (cached + new).
        window: keys seen per query, itself included; ``None`` = all earlier keys.
        sinks: number of leading keys every query sees (attention sinks), on top of the window.
        device: where to allocate.

    Returns:
        Bool tensor (L, S), True = attend.
    """
    return decode_mask(L, S, window, sinks, device=device)


# ------------------------------------------------------------------------------------------------ rotation


def rotate_at(rotary: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, E) by per-row ``positions`` (B, L) or shared ones (L,), int64 >= 0.

    Positions inside the rotary table read it (bit for bit what :meth:`RotaryEmbedding.rotate` does); past it,
    the angles are computed in float64 as the table was (a window-only cache's text may outgrow the table: its
    offsets stay below the window).
    """
    check_instance(rotary, RotaryEmbedding, "rotary", "a RotaryEmbedding")
    check_tensor(x, "x")
    check_tensor(positions, "positions")
    flat = positions.reshape(-1)
    if flat.numel() and int(flat.max()) >= rotary.max_len:
        cos, sin = rotary_angles(flat, rotary.head_dim, rotary.base)  # (N, E/2) float64
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    else:
        cos, sin = rotary.cos[flat].to(x.dtype), rotary.sin[flat].to(x.dtype)  # (N, E/2)
    half = rotary.head_dim // 2
    cos = cos.reshape(*positions.shape, half)  # (B, L, E/2) or (L, E/2)
    sin = sin.reshape(*positions.shape, half)
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]  # (B, L, E/2) -> (B, 1, L, E/2): every head alike
    return _rotate(x, cos, sin, rotary.interleaved)


# ------------------------------------------------------------------------------------------------ cache


class CacheSnapshot:
    """What :meth:`KVCache.snapshot` returns: the cache's state, opaque, to give to :meth:`KVCache.restore`.

    The cache keeps a weak reference to each snapshot while it lives: an append into slots that a live
    snapshot still counts (possible only after :meth:`KVCache.crop`) first copies the buffer, so that restoring
    the snapshot gives back exactly the tokens it saw. :meth:`release` (or leaving a ``with`` block) ends that at
    a known point, whatever still refers to the snapshot; a released snapshot cannot be restored.
    """

    __slots__ = ("owner", "state", "released", "__weakref__")

    def __init__(self, owner: object, state: tuple) -> None:
        self.owner, self.state, self.released = owner, state, False

    def release(self) -> None:
        """Done with this snapshot: the cache stops keeping slots for it (idempotent). It cannot be restored."""
        if self.released:
            return
        self.released = True
        live = getattr(self.owner, "_live", None)
        if live is not None:
            live.discard(self)
        self.state = None

    def __enter__(self) -> CacheSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _release_snapshot(state: object) -> None:
    """Release what a cache's ``snapshot()`` returned, if it can be released (a transaction's end)."""
    release = getattr(state, "release", None)
    if callable(release):
        release()


class KVCache:
    """The keys and values of every layer for the tokens generated so far (batch-first per layer).

    Per layer: a key buffer (B, H_kv, slots, E) and a value buffer (B, H_kv, slots, Ev), of which the first
    ``len(cache)`` slots are in use. :attr:`keys` and :attr:`values` are views of those slots. Keys are stored
    rotated (full and window-only caches) or before the rotation (caches with sinks): :attr:`rotated` says which.

    Args:
        num_layers: layers of the model that fills it.
        window: ``None`` (keep everything) or W >= 1: a rolling cache; each query sees itself and the W - 1
            most recent tokens, and only those (plus the sinks) are kept between steps.
        sinks: with a window, the number of first tokens kept for good (attention sinks, Xiao et al., 2023).
        max_len: slots to preallocate per layer (a static cache: a call that needs more is refused). ``None``:
            a rolling cache preallocates ``sinks + window`` slots, a full cache the first call's tokens; both grow
            by doubling when a call needs more.
        layer_windows: a full cache only (no ``window``, no ``sinks``): per layer, ``None`` (keep every token)
            or W >= 1 (keep the W - 1 most recent between calls, as a rolling cache does).
        recurrent: per layer, whether it holds a recurrent state (:meth:`state`, e.g. a gated delta layer's) instead
            of keys and values; at least one layer holds keys and values. ``None``: none does.
    """

    def __init__(self, num_layers: int, window: Optional[int] = None, sinks: int = 0, *,
                 max_len: Optional[int] = None, layer_windows: Optional[Sequence[Optional[int]]] = None,
                 recurrent: Optional[Sequence[bool]] = None) -> None:
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.window = None if window is None else check_positive_int(window, "window")
        self.sinks = check_positive_int(sinks, "sinks", allow_zero=True)
        if self.sinks and self.window is None:
            raise ValueError(f"sinks={sinks} needs a window (a full cache keeps every token anyway)")
        self.max_len = None if max_len is None else check_positive_int(max_len, "max_len")
        self.layer_windows: Optional[List[Optional[int]]] = None
        if layer_windows is not None:
            if isinstance(layer_windows, (str, bytes)) or not isinstance(layer_windows, Sequence) \
                    or len(layer_windows) != num_layers:
                raise ValueError(f"layer_windows must be a sequence of num_layers = {num_layers} windows (an int "
                                 f">= 1 or None each), got {layer_windows!r:.80}")
            if self.window is not None:
                raise ValueError(f"layer_windows is for a full cache: not with window={window} (which rolls every "
                                 "layer already)")
            self.layer_windows = [None if w is None else check_positive_int(w, f"layer_windows[{i}]")
                                  for i, w in enumerate(layer_windows)]
        self.recurrent: Tuple[bool, ...] = (False,) * num_layers
        if recurrent is not None:
            if isinstance(recurrent, (str, bytes)) or not isinstance(recurrent, Sequence) \
                    or len(recurrent) != num_layers or any(not isinstance(r, bool) for r in recurrent) \
                    or all(recurrent):
                raise ValueError(f"recurrent must be a sequence of num_layers = {num_layers} bools, not all True "
                                 f"(some layer holds keys and values), got {recurrent!r:.80}")
            self.recurrent = tuple(recurrent)
        self._ref = self.recurrent.index(False)  # a layer that holds keys and values: its length is the cache's
        self._states: List[Any] = [None] * num_layers
        self._k: List[Optional[torch.Tensor]] = [None] * num_layers
        self._v: List[Optional[torch.Tensor]] = [None] * num_layers
        self._len: List[int] = [0] * num_layers
        self.seen = 0  # tokens that went through the model (the text index of the next token)
        self.pad: Optional[torch.Tensor] = None  # (B,) left-padding slots still held, or None
        self._pad0: Optional[torch.Tensor] = None  # (B,) the first call's left padding (positions start after it)
        self._live: weakref.WeakSet[CacheSnapshot] = weakref.WeakSet()  # snapshots that may be restored

    # -- what it holds

    @property
    def rotated(self) -> bool:
        """True when keys are stored after the rotation (a cache without sinks), False when they are stored before
        it and re-rotated by slot at every step (a cache with sinks)."""
        return self.sinks == 0

    def __len__(self) -> int:
        """Tokens held now (per layer; with ``layer_windows``, by the layers that hold the most)."""
        return self._len[self._ref] if self.layer_windows is None else max(self._len)

    def state(self, layer: int) -> Any:
        """The recurrent state layer ``layer`` holds (``None`` before its first token)."""
        return self._states[self._layer(layer)]

    def set_state(self, layer: int, state: Any) -> None:
        """Replace layer ``layer``'s recurrent state (a new object: a snapshot keeps a reference to the old one)."""
        layer = self._layer(layer)
        if not self.recurrent[layer]:
            raise ValueError(f"layer {layer} holds keys and values, not a recurrent state")
        self._states[layer] = state

    def held(self, layer: int) -> int:
        """Tokens layer ``layer`` holds now (fewer than ``len(cache)`` for a layer that rolls alone)."""
        return self._len[self._layer(layer)]

    def _layer(self, layer: object) -> int:
        """``layer`` if it is an int in [0, num_layers), else ``TypeError``/``ValueError`` naming it."""
        return check_int(layer, "layer", low=0, high=self.num_layers, high_open=True, note="(num_layers)")

    @property
    def keys(self) -> List[Optional[torch.Tensor]]:
        """Per layer, the keys in use (B, H_kv, len, E), views of the buffers (``None`` while empty)."""
        return [None if b is None else b[:, :, :n] for b, n in zip(self._k, self._len)]

    @keys.setter
    def keys(self, tensors: List[Optional[torch.Tensor]]) -> None:
        self._k = list(tensors)
        self._len = [0 if t is None else t.shape[2] for t in self._k]

    @property
    def values(self) -> List[Optional[torch.Tensor]]:
        """Per layer, the values in use (B, H_kv, len, Ev), views of the buffers."""
        return [None if b is None else b[:, :, :n] for b, n in zip(self._v, self._len)]

    @values.setter
    def values(self, tensors: List[Optional[torch.Tensor]]) -> None:
        self._v = list(tensors)

    @property
    def slots(self) -> int:
        """Slots allocated per layer (>= ``len(cache)``)."""
        return 0 if self._k[self._ref] is None else self._k[self._ref].shape[2]

    @property
    def capacity(self) -> Optional[int]:
        """Keys a query may see at most (sinks + window), or ``None`` for a full cache."""
        return None if self.window is None else self.sinks + self.window

    @property
    def batch_size(self) -> Optional[int]:
        """B of the cached tensors, or ``None`` while the cache is empty (any batch may fill it)."""
        ref = self._k[self._ref]
        return None if len(self) == 0 or ref is None else ref.shape[0]

    def nbytes(self) -> int:
        """Bytes of the keys and values in use (the preallocated slack not counted), and of the recurrent states."""
        kv = sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store if t is not None)
        return kv + sum(s.nbytes() for s in self._states if s is not None)

    def positions(self, L: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """Positions of the next ``L`` tokens: (L,), or (B, L) with left padding (padding rows clamped to 0)."""
        L = check_positive_int(L, "L", allow_zero=True)
        pos = torch.arange(self.seen, self.seen + L, device=device)  # (L,)
        if self.pad is None:
            return pos
        return (pos[None] - self._pad0.to(pos.device)[:, None]).clamp(min=0)  # (B, L)

    # -- writing

    def check_room(self, L: int) -> None:
        """Raise ``ValueError`` if a call of ``L`` tokens needs more slots than a static cache has (or ``L`` is not an
        int >= 0)."""
        L = check_positive_int(L, "L", allow_zero=True)
        if self.max_len is not None and len(self) + L > self.max_len:
            raise ValueError(f"the cache holds {len(self)} tokens and the call adds L = {L}: "
                             f"{len(self) + L} slots, but it was built with max_len = {self.max_len}")

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys and values (B, H_kv, L, E) after its cached ones; return all of them (views)."""
        layer = self._layer(layer)
        for name, t in (("key", key), ("value", value)):
            if check_tensor(t, name).dim() != 4:
                raise ValueError(f"{name} must be (B, H_kv, L, E), got shape {tuple(t.shape)}")
        B, H, L, _ = key.shape
        n = self._len[layer]
        buf_k, buf_v = self._k[layer], self._v[layer]
        if buf_k is not None and n == 0 and (buf_k.shape[:2] != key.shape[:2] or buf_k.dtype != key.dtype
                                             or buf_k.device != key.device or buf_v.shape[1] != value.shape[1]):
            buf_k = buf_v = None  # an emptied cache takes another batch (or dtype): new buffers
        if buf_k is None or n + L > buf_k.shape[2]:
            if buf_k is None:
                want = self.max_len or (L if self.window is None else max(L, self.sinks + self.window))
            else:
                want = max(2 * buf_k.shape[2], n + L)  # grow by doubling
                if self.max_len is not None:
                    want = min(want, self.max_len)
            new_k = key.new_empty(B, H, want, key.shape[3])  # (B, H, slots, E)
            new_v = value.new_empty(B, value.shape[1], want, value.shape[3])
            if buf_k is not None:
                new_k[:, :, :n], new_v[:, :, :n] = buf_k[:, :, :n], buf_v[:, :, :n]
            buf_k, buf_v = new_k, new_v
            self._k[layer], self._v[layer] = buf_k, buf_v
        elif any(snap.state[0][layer] is buf_k and snap.state[2][layer] > n for snap in list(self._live)):
            # a live snapshot still counts slots n.. (the cache was cropped since): write into a copy, so that
            # restoring it gives back exactly what it saw
            buf_k, buf_v = buf_k.clone(), buf_v.clone()
            self._k[layer], self._v[layer] = buf_k, buf_v
        buf_k[:, :, n : n + L] = key  # in place: the slots after the cached ones
        buf_v[:, :, n : n + L] = value
        self._len[layer] = n + L
        return buf_k[:, :, : n + L], buf_v[:, :, : n + L]

    def set_padding(self, pad: Optional[torch.Tensor]) -> None:
        """Record the left padding of the first call's rows, (B,) int64 (an empty cache only)."""
        if pad is not None and (check_tensor(pad, "pad").dim() != 1 or pad.dtype.is_floating_point
                                or pad.is_complex() or pad.dtype == torch.bool):
            raise ValueError(f"pad must be a (B,) integer tensor of left-padding counts, got {pad.dtype} of shape "
                             f"{tuple(pad.shape)}")
        self.pad = None if pad is None else pad.to(torch.long)
        self._pad0 = self.pad

    def step_done(self, new_tokens: int) -> None:
        """Count ``new_tokens`` as seen and evict what no later query will see (rolling cache only).

        Raises:
            TypeError, ValueError: ``new_tokens`` is not an int >= 0 (nothing is counted).
        """
        new_tokens = check_positive_int(new_tokens, "new_tokens", allow_zero=True)
        self.seen += new_tokens
        if self.layer_windows is not None:
            for layer, w in enumerate(self.layer_windows):
                n = self._len[layer]
                if w is not None and n > w - 1:  # this layer rolls alone: keep its W - 1 most recent tokens
                    for buf in (self._k[layer], self._v[layer]):
                        buf[:, :, : w - 1] = buf[:, :, n - (w - 1) : n].clone()
                    self._len[layer] = w - 1
            return
        n = len(self)
        if self.window is None or n <= self.sinks + self.window - 1:
            return
        keep = self.window - 1  # the next query brings its own key: W - 1 earlier ones complete its window
        s = self.sinks
        for layer in (i for i in range(self.num_layers) if not self.recurrent[i]):
            for buf in (self._k[layer], self._v[layer]):
                buf[:, :, s : s + keep] = buf[:, :, n - keep : n].clone()  # move the recent ones to the front
            self._len[layer] = s + keep
        if self.pad is not None:
            self.pad = (self.pad - (n - keep)).clamp(min=0)  # padding is never a sink (no sinks with padding)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens only (a full cache; speculative decoding rolls back rejected drafts)."""
        if self.window is not None or (self.layer_windows and any(w is not None for w in self.layer_windows)):
            raise ValueError("crop needs a full cache (a rolling cache has evicted the slots it would return to)")
        if any(self.recurrent):
            raise ValueError("crop needs a cache of keys and values only: a recurrent state (a gated delta layer's) "
                             "cannot return to an earlier token")
        n = check_positive_int(n, "n", allow_zero=True)
        if n > len(self):
            raise ValueError(f"crop(n={n}) but the cache holds {len(self)} tokens")
        self._len = [min(n, m) for m in self._len]
        self.seen = n

    def reset(self) -> None:
        """Forget every cached token (the cache may then take a batch of another size)."""
        self._k = [None] * self.num_layers
        self._v = [None] * self.num_layers
        self._len = [0] * self.num_layers
        self._states = [None] * self.num_layers
        self.seen = 0
        self.pad = self._pad0 = None

    # -- transactions

    def snapshot(self) -> CacheSnapshot:
        """The cache's state, to :meth:`restore` if a call fails half-way (or to roll back to later).

        Appends write only past the slots in use, growth allocates new buffers, and an append into slots that a
        live snapshot still counts (after a :meth:`crop`) copies the buffer first: so the buffers' references and
        the lengths are enough for a full cache. A rolling cache's eviction moves tokens in place, so its (small:
        at most sinks + window tokens) held slots are copied too.
        """
        held = None
        if self.window is not None:
            held = [(k.clone(), v.clone()) if k is not None else None for k, v in zip(self.keys, self.values)]
        elif self.layer_windows is not None:  # the layers that roll alone move their tokens in place
            held = [(k.clone(), v.clone()) if k is not None and w is not None else None
                    for k, v, w in zip(self.keys, self.values, self.layer_windows)]
        snap = CacheSnapshot(self, (list(self._k), list(self._v), list(self._len), self.seen, self.pad, self._pad0,
                                    held, list(self._states)))
        self._live.add(snap)
        return snap

    def restore(self, state: CacheSnapshot) -> None:
        """Put back a :meth:`snapshot` of this cache: the cache is exactly as it was when it was taken."""
        if not isinstance(state, CacheSnapshot):
            raise TypeError(f"state must be what this cache's snapshot() returned, got {type(state).__name__}")
        if state.owner is not self:
            raise ValueError("state is a snapshot of another cache: restore it into the cache that took it")
        if state.released:
            raise ValueError("state was released (its slots are no longer kept): it cannot be restored")
        ks, vs, lens, seen, pad, pad0, held, states = state.state
        self._k, self._v, self._len, self.seen, self.pad, self._pad0 = list(ks), list(vs), list(lens), seen, pad, pad0
        self._states = list(states)  # states are replaced, never written in place: the references suffice
        if held is not None:
            for layer, kv in enumerate(held):
                if kv is not None:
                    n = kv[0].shape[2]
                    self._k[layer][:, :, :n] = kv[0]
                    self._v[layer][:, :, :n] = kv[1]
