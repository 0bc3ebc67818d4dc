"""One mask language: masks as predicates (``mask_mod``) and score edits (``score_mod``), PyTorch's FlexAttention's.

A **mask_mod** says whether query ``q_idx`` may read key ``kv_idx`` in batch ``b``, head ``h``::

    mask_mod(b, h, q_idx, kv_idx) -> bool tensor        True = the pair takes part (SDPA's convention)

A **score_mod** edits one score before the softmax (a bias, a cap, or ``-inf`` to remove the pair)::

    score_mod(score, b, h, q_idx, kv_idx) -> score tensor

The arguments are integer tensors that broadcast against each other (``attention_core`` calls a mod with
index grids such as ``q_idx`` of shape (L, 1) and ``kv_idx`` of shape (1, S); PyTorch calls it with 0-d tensors
under ``vmap``), so a mod is written with tensor operations only: ``&``, ``|``, ``~``, comparisons, indexing a
tensor it captured, never Python's ``and``/``if`` on an index. Written that way, the same function runs here on
any backend and in ``torch.nn.attention.flex_attention`` on a GPU, unchanged.

The mods below are the masks of the literature. Each factory returns a mod; :func:`causal` is itself one.
Positions count from 0 at the start of each sequence (upper-left alignment, as SDPA's ``is_causal``), except
:func:`causal_bottom_right`, the decode mask, which aligns the last query with the last key.

:func:`dense_mask` and :func:`dense_scores` evaluate a mod on every pair: the O(L * S) oracle the tests and
the ``reference`` backend use. :func:`attention_core.flex_attention.create_block_mask` never does that at once.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch

from attention_core._checks import (
    MAX_SIZE,
    check_device,
    check_floating,
    check_int,
    check_rank,
    check_tensor,
    fmt_shape,
    short_repr,
)

__all__ = [
    "MaskMod",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "check_captured",
    "causal",
    "causal_bottom_right",
    "dense_mask",
    "dense_scores",
    "document",
    "fixed",
    "index_grids",
    "key_padding",
    "longformer",
    "noop_mask",
    "noop_score",
    "or_masks",
    "prefix_lm",
    "relative_position_bias",
    "sinks_and_window",
    "sliding_window",
    "soft_cap",
    "strided",
]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = the pair takes part).
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (the edited score, same dtype).
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _positive(value: int, name: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ValueError(f"{name} must be an int >= {0 if allow_zero else 1}, got {value!r}")
    return value


def _named(fn, name: str, kind: tuple | None = None, captures: tuple = ()):
    """Name a mod for reprs; ``kind`` (the factory and its arguments) lets a compiled backend recognise it;
    ``captures`` says what it indexes in the tensors it captured (see :func:`check_captured`)."""
    fn.__name__ = fn.__qualname__ = name
    fn.flex_kind = kind
    fn.flex_captures = captures
    return fn


def _captures_of(*mods) -> tuple:
    return tuple(c for m in mods for c in getattr(m, "flex_captures", ()))


def check_captured(mod, B: int, H: int, L: int, S: int, device: torch.device) -> None:
    """Refuse a tensor that ``mod`` captured and indexes by query head, batch row or position when it is too
    short for these inputs, or on another device, naming the tensor and what it must cover (torch's
    FlexAttention raises an IndexError in eager mode; a compiled kernel would read past the tensor).

    A mod says what it indexes in ``mod.flex_captures``: ``(mod name, tensor name, tensor, dim, over)`` entries,
    ``over`` one of ``"heads"``, ``"positions"`` (max(L, S)), ``"batch"``; the library's factories and
    :func:`and_masks` / :func:`or_masks` set it.

    Raises:
        TypeError: ``mod`` is neither callable nor None, ``B``/``H``/``L``/``S`` not ints or ``device`` not a
            ``torch.device``.
        ValueError: ``B``/``H``/``L``/``S`` below 0, or a captured tensor as above."""
    if mod is not None and not callable(mod):
        raise TypeError(f"mod must be a mask or score mod (a callable) or None, got {type(mod).__name__} "
                        f"{short_repr(mod)}")
    if not torch.compiler.is_compiling():  # traced sizes may be symbolic: the eager call checked them
        for value, name in ((B, "B"), (H, "H"), (L, "L"), (S, "S")):
            check_int(value, name, low=0)
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device (the query's), got {type(device).__name__} "
                        f"{short_repr(device)}")
    needs = {"heads": (H, "query heads"), "positions": (max(L, S), "positions (max(L, S))"),
             "batch": (B, "batch rows")}
    for owner, name, t, dim, over in getattr(mod, "flex_captures", ()):
        if t.device != device:
            raise ValueError(f"the {owner} mod's captured {name} is on {t.device}, the query on {device}: move one")
        needed, what = needs[over]
        if t.shape[dim] < needed:
            raise ValueError(f"the {owner} mod's captured {name} of shape {tuple(t.shape)} covers {t.shape[dim]} "
                             f"{what.split(' (')[0]} in dim {dim}, fewer than the {needed} {what} of these inputs")


# ------------------------------------------------------------------------------------------ combinators


def noop_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Every pair takes part (the mask of plain attention)."""
    return q_idx.new_ones((), dtype=torch.bool)


noop_mask.flex_kind = ("noop",)


def noop_score(score, b, h, q_idx, kv_idx):
    """The score unchanged."""
    return score


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A pair takes part when **every** mod lets it (no mods: every pair). PyTorch's ``and_masks``."""
    return _joined("and", mask_mods)


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A pair takes part when **any** mod lets it (no mods: no pair). PyTorch's ``or_masks``."""
    return _joined("or", mask_mods)


def _joined(kind: str, mask_mods: tuple[MaskMod, ...]) -> MaskMod:
    """``and_masks`` (``kind="and"``) or ``or_masks`` (``"or"``) of ``mask_mods``, named and with their flex kinds
    and captured tensors, as :func:`_named` records them."""
    if not all(callable(m) for m in mask_mods):
        raise TypeError(f"{kind}_masks takes mask_mod callables, got {[type(m).__name__ for m in mask_mods]}")
    every = kind == "and"
    join = operator.and_ if every else operator.or_  # keep & answer, or keep | answer

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx.new_ones((), dtype=torch.bool) if every else q_idx.new_zeros((), dtype=torch.bool)
        for m in mask_mods:
            keep = join(keep, m(b, h, q_idx, kv_idx))
        return keep

    return _named(mask_mod, f"{kind}_masks(" + ", ".join(getattr(m, "__name__", "mod") for m in mask_mods) + ")",
                  (kind, *(getattr(m, "flex_kind", None) for m in mask_mods)), _captures_of(*mask_mods))


# ------------------------------------------------------------------------------------------- mask mods


def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Query ``i`` reads keys ``j <= i`` (SDPA's ``is_causal``, upper-left aligned)."""
    return kv_idx <= q_idx


causal.flex_kind = ("causal",)


def causal_bottom_right(L: int, S: int) -> MaskMod:
    """The decode mask: the last of ``L`` queries sits at the last of ``S`` keys, ``j <= i + (S - L)``.

    With a cache of ``S - L`` earlier keys, query ``i`` of the new block is position ``i + S - L``. For
    ``L > S`` the first ``L - S`` queries read nothing (their rows come out as zeros).
    """
    offset = _positive(S, "S", allow_zero=True) - _positive(L, "L", allow_zero=True)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return _named(mask_mod, f"causal_bottom_right({L}, {S})", ("causal_bottom_right", offset))


def sliding_window(window: int, causal: bool = True) -> MaskMod:
    """Local attention (Longformer, Mistral), the same pairs as :func:`attention_core.masks.sliding_window_mask`.

    ``causal=True``: query ``i`` reads the ``window`` most recent keys, itself included, ``i - window < j <= i``;
    ``causal=False``: ``|i - j| <= window // 2``.
    """
    window = _positive(window, "window")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx).abs() <= window // 2
    return _named(mask_mod, f"sliding_window({window}, causal={causal})", ("sliding_window", window, causal))


def sinks_and_window(sinks: int, window: int) -> MaskMod:
    """StreamingLLM (Xiao et al. 2023): the first ``sinks`` keys plus a causal window of ``window`` keys.

    Query ``i`` reads ``j <= i`` with ``j < sinks`` or ``i - window < j``.
    """
    sinks, window = _positive(sinks, "sinks", allow_zero=True), _positive(window, "window")

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sinks) | (q_idx - kv_idx < window))

    return _named(mask_mod, f"sinks_and_window({sinks}, {window})", ("sinks_and_window", sinks, window))


def document(document_ids: torch.Tensor) -> MaskMod:
    """Packed sequences: a query reads only keys of its own document (combine with :func:`causal` for a decoder).

    Args:
        document_ids: (N,) integer tensor, the document of every position (N >= L and N >= S), or (B, N) for
            a different packing per batch row.
    """
    if not isinstance(document_ids, torch.Tensor) or document_ids.is_floating_point() or (
            document_ids.dtype == torch.bool):
        raise TypeError(f"document_ids must be a (N,) or (B, N) integer tensor, got {type(document_ids).__name__} "
                        f"{short_repr(document_ids)}")
    if document_ids.dim() not in (1, 2):
        raise ValueError(f"document_ids must be a (N,) or (B, N) integer tensor, got shape "
                         f"{fmt_shape(document_ids.shape)}")
    ids = document_ids

    if ids.dim() == 1:
        def mask_mod(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return ids[b, q_idx] == ids[b, kv_idx]
    captures = (("document", "document_ids", ids, -1, "positions"),)
    if ids.dim() == 2:
        captures += (("document", "document_ids", ids, 0, "batch"),)
    return _named(mask_mod, "document", ("document", ids), captures)


def key_padding(kv_lens: torch.Tensor | Sequence[int]) -> MaskMod:
    """Batch row ``b`` reads its first ``kv_lens[b]`` keys (the padding keys after them are never read)."""
    if isinstance(kv_lens, torch.Tensor):
        if kv_lens.is_floating_point() or kv_lens.dtype == torch.bool:
            raise TypeError(f"kv_lens must be B integer lengths >= 0, got a {kv_lens.dtype} tensor")
    elif not isinstance(kv_lens, Sequence) or isinstance(kv_lens, str) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in kv_lens):
        raise TypeError(f"kv_lens must be B integer lengths >= 0 (a tensor or a sequence of ints), got "
                        f"{type(kv_lens).__name__} {short_repr(kv_lens)}")
    lens = torch.as_tensor(kv_lens, dtype=torch.long)
    if lens.dim() != 1 or bool((lens < 0).any()):
        raise ValueError(f"kv_lens must be B lengths >= 0, got {kv_lens!r:.80}")

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < lens.to(kv_idx.device)[b]

    return _named(mask_mod, "key_padding")


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix LM (Raffel et al. 2020, T5): the first ``prefix_len`` keys are read by every query; after them, causal."""
    prefix_len = _positive(prefix_len, "prefix_len", allow_zero=True)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (kv_idx <= q_idx)

    return _named(mask_mod, f"prefix_lm({prefix_len})", ("prefix_lm", prefix_len))


def strided(stride: int) -> MaskMod:
    """Child et al. 2019, strided pattern: causal, the last ``stride`` keys, and every ``stride``-th key before them.

    Query ``i`` reads ``j <= i`` with ``i - j < stride`` or ``(i - j) % stride == 0`` (their two heads' union).
    """
    stride = _positive(stride, "stride")

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & ((d < stride) | (d % stride == 0))

    return _named(mask_mod, f"strided({stride})")


def fixed(stride: int, c: int = 1) -> MaskMod:
    """Child et al. 2019, fixed pattern: causal, the query's own block of ``stride`` keys, and the last ``c`` keys
    of every block (the "summary" columns): ``j // stride == i // stride`` or ``j % stride >= stride - c``."""
    stride, c = _positive(stride, "stride"), _positive(c, "c")
    if c > stride:
        raise ValueError(f"c must be at most stride={stride}, got {c}")

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx // stride == kv_idx // stride) | (kv_idx % stride >= stride - c))

    return _named(mask_mod, f"fixed({stride}, {c})")


def longformer(window: int, global_tokens: int | torch.Tensor) -> MaskMod:
    """Longformer (Beltagy et al. 2020): a two-sided window ``|i - j| <= window // 2`` plus global tokens, which
    read every key and are read by every query.

    Args:
        window: window size (``window // 2`` keys on each side; :func:`attention_core.sparse_patterns.longformer_mod`
            takes the half-width instead, so ``longformer(2 * w, g)`` is its ``longformer_mod(w, ...)`` without
            causality).
        global_tokens: an int ``n`` (the first ``n`` positions are global, as a [CLS] token) or a (N,) bool
            tensor, True at the global positions (N >= L and N >= S).
    """
    window = _positive(window, "window")
    if isinstance(global_tokens, torch.Tensor):
        if global_tokens.dtype != torch.bool or global_tokens.dim() != 1:
            raise ValueError(f"global_tokens must be an int or a (N,) bool tensor, got {global_tokens!r:.80}")
        is_global = global_tokens

        def mask_mod(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx).abs() <= window // 2) | is_global[q_idx] | is_global[kv_idx]
    else:
        n = _positive(global_tokens, "global_tokens", allow_zero=True)

        def mask_mod(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx).abs() <= window // 2) | (q_idx < n) | (kv_idx < n)
    return _named(mask_mod, f"longformer({window})")


# ------------------------------------------------------------------------------------------ score mods


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022): ``2**(-8 (h + 1) / H)`` for H a power of two; otherwise the
    slopes of the next smaller power of two, then every other one of the next larger, as the paper's code does."""
    num_heads = _positive(num_heads, "num_heads")
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (i + 1) / n) for i in range(n)]
    if n < num_heads:
        slopes += [2 ** (-4 * (2 * i + 1) / n) for i in range(num_heads - n)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi (Press et al. 2022): adds ``slopes[h] * (j - i)``, a penalty growing with the distance to the past.

    Args:
        slopes: (H,) float tensor, one slope per head (see :func:`alibi_slopes`); may require grad (the
            ``chunked`` backend returns its gradient as the dense reference does).
    """
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        raise TypeError(f"slopes must be a (H,) float tensor, got {type(slopes).__name__} {short_repr(slopes)}")
    if slopes.dim() != 1:
        raise ValueError(f"slopes must be a (H,) float tensor, got shape {fmt_shape(slopes.shape)}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return _named(score_mod, "alibi", ("alibi", slopes), (("alibi", "slopes", slopes, 0, "heads"),))


def soft_cap(cap: float) -> ScoreMod:
    """Tanh soft-capping (Gemma 2): ``cap * tanh(score / cap)``, scores squashed into (-cap, cap)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or math.isinf(cap):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    cap = float(cap)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return _named(score_mod, f"soft_cap({cap:g})", ("soft_cap", cap))


def relative_position_bias(table: torch.Tensor, max_distance: int) -> ScoreMod:
    """A learned scalar bias per head and relative position, T5's bias without its buckets (Shaw et al. 2018
    learn relative-position vectors instead, clipped at a maximum distance as here):
    adds ``table[h, clamp(j - i, -max_distance, max_distance) + max_distance]``.

    Args:
        table: (H, 2 * max_distance + 1) float tensor; may require grad (its gradient flows through ``chunked``).
        max_distance: distances beyond it share the end entries.
    """
    max_distance = _positive(max_distance, "max_distance", allow_zero=True)
    if (not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point()
            or table.shape[1] != 2 * max_distance + 1):
        raise ValueError(f"table must be a (H, 2 * max_distance + 1 = {2 * max_distance + 1}) float tensor, "
                         f"got {getattr(table, 'shape', table)!r:.80}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-max_distance, max_distance) + max_distance]

    return _named(score_mod, "relative_position_bias", ("relative_position_bias", table, max_distance),
                  (("relative_position_bias", "table", table, 0, "heads"),))


# ------------------------------------------------------------------------------------------ dense oracle


def index_grids(B: int, H: int, L: int, S: int, device=None) -> tuple[torch.Tensor, ...]:
    """``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, L, 1), ``kv_idx`` (1, 1, 1, S): int64 index
    grids that broadcast to (B, H, L, S), the way every mod is called here. The sizes are ints >= 0 and
    ``device`` is ``None`` or a device this machine has (``TypeError``/``ValueError`` naming the argument)."""
    for name, n in (("B", B), ("H", H), ("L", L), ("S", S)):
        check_int(n, name, low=0, high=MAX_SIZE)
    device = check_device(device)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(L, device=device).view(1, 1, L, 1)
    kv = torch.arange(S, device=device).view(1, 1, 1, S)
    return b, h, q, kv


def _check_callable(mod: object, name: str) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``mod`` is callable (a mask or score mod)."""
    if not callable(mod):
        raise TypeError(f"{name} must be a function (a {name}), got {type(mod).__name__} {short_repr(mod)}")


def _mod_name(mod) -> str:
    return str(getattr(mod, "__name__", type(mod).__name__))


def call_mask_mod(mask_mod: MaskMod, b, h, q_idx, kv_idx, shape: tuple[int, ...]) -> torch.Tensor:
    """``mask_mod(b, h, q_idx, kv_idx)`` checked: a bool tensor that broadcasts to ``shape`` (the grids'
    broadcast), else a ``TypeError``/``ValueError`` naming the mod; an ``IndexError`` or ``RuntimeError`` inside
    it (a captured tensor shorter than the positions, batch rows or heads asked for) becomes a ``ValueError``
    that says which grids it was called on. Returns the answer broadcast to ``shape`` (a view)."""
    try:
        keep = mask_mod(b, h, q_idx, kv_idx)
    except (IndexError, RuntimeError) as err:
        raise ValueError(_failed("mask_mod", mask_mod, err, b, h, q_idx, kv_idx)) from err
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"a mask_mod must return a bool tensor, {_mod_name(mask_mod)} returned "
                        f"{type(keep).__name__} {getattr(keep, 'dtype', '')}")
    return _broadcast(keep, shape, "mask_mod", mask_mod)


def call_score_mod(score_mod: ScoreMod, score: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    """``score_mod(score, b, h, q_idx, kv_idx)`` checked as :func:`call_mask_mod` checks a mask_mod: a floating
    tensor that broadcasts to ``score``'s shape (returned broadcast to it)."""
    try:
        out = score_mod(score, b, h, q_idx, kv_idx)
    except (IndexError, RuntimeError) as err:
        raise ValueError(_failed("score_mod", score_mod, err, b, h, q_idx, kv_idx)) from err
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise TypeError(f"a score_mod must return a floating tensor (the edited score), {_mod_name(score_mod)} "
                        f"returned {type(out).__name__} {getattr(out, 'dtype', '')}")
    return _broadcast(out, tuple(score.shape), "score_mod", score_mod)


def _failed(kind: str, mod, err: Exception, b, h, q_idx, kv_idx) -> str:
    def span(t) -> str:
        return f"{int(t.min())}..{int(t.max())}" if isinstance(t, torch.Tensor) and t.numel() and \
            t.device.type != "meta" else "-"
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (f"{kind} {_mod_name(mod)} failed on b in {span(b)}, h in {span(h)}, q_idx in {span(q_idx)}, "
            f"kv_idx in {span(kv_idx)}: {reason} (a tensor it captured may cover fewer batch rows, heads or "
            f"positions than these inputs)")


def _broadcast(x: torch.Tensor, shape: tuple[int, ...], kind: str, mod) -> torch.Tensor:
    try:
        return x.expand(shape) if tuple(x.shape) != tuple(shape) else x
    except RuntimeError:
        raise ValueError(f"{kind} {_mod_name(mod)} returned shape {tuple(x.shape)}, which does not broadcast to "
                         f"{tuple(shape)} (the broadcast of its index arguments)") from None


def dense_mask(mask_mod: MaskMod, B: int, H: int, L: int, S: int, device=None) -> torch.Tensor:
    """The mod evaluated on every pair: bool (B, H, L, S), True = attend. O(B H L S) memory: for tests and small
    pictures; use :func:`attention_core.flex_attention.create_block_mask` for attention. The sizes are ints
    >= 0 (checked by :func:`index_grids`)."""
    _check_callable(mask_mod, "mask_mod")
    return call_mask_mod(mask_mod, *index_grids(B, H, L, S, device), (B, H, L, S))


def dense_scores(score_mod: ScoreMod, scores: torch.Tensor) -> torch.Tensor:
    """The score mod applied to a full (B, H, L, S) floating score tensor (differentiable, as the mod is)."""
    _check_callable(score_mod, "score_mod")
    check_tensor(scores, "scores")
    check_rank(scores, "scores", (4,), "(B, H, L, S)")
    check_floating(scores, "scores")
    B, H, L, S = scores.shape
    return call_score_mod(score_mod, scores, *index_grids(B, H, L, S, scores.device))
