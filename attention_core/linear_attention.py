"""Linear attention, the delta rule and random features for the softmax kernel.

Softmax attention weighs value ``j`` for query ``i`` by ``exp(q_i . k_j)``: a kernel smoother
(chapter 1) with the kernel ``exp(q . k)``. Replace the kernel by a dot product of feature maps,
``phi(q) . phi(k)``, and the sums over keys factor (Katharopoulos et al., 2020)::

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / phi(q_i)^T (sum_j phi(k_j))

The two sums are a (Dphi, Ev) matrix ``S`` and a (Dphi,) vector ``z``; causal attention keeps running sums, so
decoding is an RNN whose state has a fixed size, whatever the length.

- :func:`linear_attention`: the parallel form (an (L, S) matrix of kernel values, masked if causal);
- :func:`linear_attention_recurrent`: the recurrent form (one state update per key), with its final state;
- :func:`linear_attention_chunked`: causal, chunk by chunk (parallel inside a chunk, the state across chunks);
- :func:`delta_rule`: the delta rule (Schlag et al., 2021): write ``beta (v - S k) k^T`` instead of ``v k^T``;
- :func:`gated_delta_rule_recurrent`, :func:`gated_delta_rule_chunked`: the gated delta rule (Yang, Kautz &
  Hatamizadeh, ICLR 2025), ``S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T``, token by token
  and chunk by chunk (the WY / UT-transform algorithm), with :class:`GatedDeltaState` for decoding;
- :func:`performer_features`, :func:`performer_variance`: random features whose dot product estimates
  ``exp(x . y)`` without bias (Choromanski et al., 2021), positive and trigonometric, and their
  closed-form variance (the paper's Lemma 2).

Shapes: ``query (..., L, E)``, ``key (..., S, E)``, ``value (..., S, Ev)`` -> ``(..., L, Ev)``. Causal means
key ``j <= i`` (upper-left aligned, as SDPA's ``is_causal``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention_core._checks import (
    check_bool_flag,
    check_fits,
    check_floating,
    check_floating_dtype,
    check_min_rank,
    check_positive_float,
    check_positive_int,
    check_same_device,
    check_same_dtype,
    check_tensor,
    check_tensors_fit,
    fmt_shape,
    short_repr,
)
from attention_core._nonfinite import all_finite, bad_rows, check_on_host, nan_rows, zero_nonfinite

__all__ = [
    "FEATURE_MAPS",
    "GatedDeltaState",
    "LinearAttentionState",
    "delta_rule",
    "draw_omega",
    "elu_feature_map",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "linear_attention",
    "linear_attention_chunked",
    "linear_attention_recurrent",
    "performer_features",
    "performer_kernel_estimate",
    "performer_variance",
    "softmax_kernel",
]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1``: positive everywhere, Katharopoulos et al.'s feature map (same shape as ``x``, a floating
    tensor: ``TypeError`` naming ``x`` otherwise)."""
    check_tensor(x, "x")
    check_floating(x, "x")
    return F.elu(x) + 1.0


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


#: Feature maps by name. ``"identity"`` (no map) with ``normalize=False`` is the plain linear memory
#: ``S = sum_j v_j k_j^T`` read by ``S q``.
FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu": elu_feature_map,
    "relu": F.relu,
    "identity": _identity,
}

FeatureMap = str | Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LinearAttentionState:
    """The state of causal linear attention after some keys: ``S (..., Dphi, Ev)`` = sum of ``phi(k) v^T``,
    ``z (..., Dphi)`` = sum of ``phi(k)``. Its size does not depend on how many keys it has seen."""

    S: torch.Tensor
    z: torch.Tensor

    def nbytes(self) -> int:
        """Bytes the state occupies."""
        return self.S.numel() * self.S.element_size() + self.z.numel() * self.z.element_size()


def _feature_map(feature_map: FeatureMap) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, "
                             f"got {short_repr(feature_map)}")
        return FEATURE_MAPS[feature_map]
    if not callable(feature_map):
        raise TypeError(f"feature_map must be a str or a callable, got {type(feature_map).__name__}")
    return feature_map


def _features(phi: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor, key: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``phi(query)``, ``phi(key)``, checked: floating tensors (..., L, Dphi) and (..., S, Dphi) of the inputs'
    leading dims, one dtype and device, the same Dphi; else a ``TypeError``/``ValueError`` naming feature_map."""
    fq, fk = phi(query), phi(key)  # (..., L, Dphi), (..., S, Dphi)
    for name, f, x in (("query", fq, query), ("key", fk, key)):
        if not isinstance(f, torch.Tensor) or not f.is_floating_point():
            raise TypeError(f"feature_map must return a floating tensor, got {type(f).__name__} "
                            f"{getattr(f, 'dtype', '')} for the {name}")
        if f.shape[:-1] != x.shape[:-1] or f.dim() != x.dim():
            raise ValueError(f"feature_map must map (..., N, E) to (..., N, Dphi), got {fmt_shape(f.shape)} for the "
                             f"{name} of shape {fmt_shape(x.shape)}")
    if fq.shape[-1] != fk.shape[-1] or fq.dtype != fk.dtype or fq.device != fk.device:
        raise ValueError(f"feature_map must give the query and the key features of one size, dtype and device, "
                         f"got {fmt_shape(fq.shape)} {fq.dtype} and {fmt_shape(fk.shape)} {fk.dtype}")
    return fq, fk


def _check_qkv(query: object, key: object, value: object, *, causal: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(t, name)
        check_floating(t, name)
        check_min_rank(t, name, 2, "(..., L, E)")
    check_same_dtype(query=query, key=key, value=value)
    check_same_device(query=query, key=key, value=value)
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share the last dim E, got query {fmt_shape(query.shape)} "
                         f"and key {fmt_shape(key.shape)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"key (..., S, E) and value (..., S, Ev) must agree on (..., S), got key "
                         f"{fmt_shape(key.shape)} and value {fmt_shape(value.shape)}")
    if query.shape[:-2] != key.shape[:-2]:
        raise ValueError(f"query and key must share the batch dims, got query {fmt_shape(query.shape)} and key "
                         f"{fmt_shape(key.shape)}")
    check_tensors_fit("linear attention", query=query, key=key, value=value)  # read element by element
    if causal and query.shape[-2] > key.shape[-2]:
        raise ValueError(f"causal linear attention needs L <= S (query i reads keys 0..i), got L = "
                         f"{query.shape[-2]} and S = {key.shape[-2]}")


def _check_common(is_causal: object, normalize: object, eps: object) -> float:
    check_bool_flag(is_causal, "is_causal")
    check_bool_flag(normalize, "normalize")
    return check_positive_float(eps, "eps", allow_zero=True)


def _normalized(num: torch.Tensor, den: torch.Tensor | None, eps: float) -> torch.Tensor:
    return num if den is None else num / (den.unsqueeze(-1) + eps)


def _clean_features(phi: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``phi(query)``, ``phi(key)`` and ``value`` under the non-finite policy of the parallel and chunked forms,
    which is the recurrent form's: a NaN or inf in ``phi(q_i)`` makes row ``i`` NaN; one in ``phi(k_j)`` or
    ``v_j`` makes NaN every row that reads key ``j`` (rows ``i >= j`` if causal, every row if not), and no
    other. A masked product ``0 * NaN`` is NaN, so the bad rows are zeroed before any product (in the inputs,
    so that no gradient passes through a NaN either) and the NaN is put back afterwards. Returns the features,
    the value and the (..., L, 1) NaN-or-0 tensor to add to the output (``None`` when all is finite).
    A poisoned row is NaN in every column, as in :func:`attention_core.scaled_dot_product_attention` (the
    recurrent form's running sums may keep a value's NaN in its own column, or give inf: the same rows)."""
    fq, fk = _features(phi, query, key)  # (..., L, Dphi), (..., S, Dphi)
    if check_on_host(fq, fk, value) and bool(all_finite(fq, fk, value, None)):
        return fq, fk, value, None
    L, S = fq.shape[-2], fk.shape[-2]
    bad_q = bad_rows(fq)  # (..., L); a -inf key is no bad row when its feature is finite (elu + 1 gives 0)
    bad_kv = bad_rows(fk) | bad_rows(value)  # (..., S): the key's features or its value hold a NaN or inf
    fq, fk = _features(phi, query.masked_fill(bad_q[..., None], 0.0), key.masked_fill(bad_kv[..., None], 0.0))
    value = value.masked_fill(bad_kv[..., None], 0.0)
    if causal:  # row i reads keys 0..i: a prefix "any"
        reads_bad = (bad_kv.to(torch.int32).cumsum(-1) > 0)[..., :L]  # (..., L)
    else:  # every row reads every key
        reads_bad = bad_kv.any(-1, keepdim=True).expand(*bad_kv.shape[:-1], L)  # (..., L)
    rows = (bad_q & (S > 0)) | reads_bad  # (..., L); a row that reads no key stays zeros
    # a feature map that is not finite at 0 either: its features are cleaned too
    return zero_nonfinite(fq), zero_nonfinite(fk), value, nan_rows(rows, value).unsqueeze(-1)  # (..., L, 1)


def _poisoned(out: torch.Tensor, poison: torch.Tensor | None) -> torch.Tensor:
    return out if poison is None else out + poison.to(out.dtype)  # NaN in the poisoned rows, + 0 elsewhere


def linear_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
                     feature_map: FeatureMap = "elu", normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Linear attention in its parallel form: the (L, S) matrix ``phi(Q) phi(K)^T``, masked if causal,
    row-normalized if ``normalize``, times ``V``. O(L S) work, as softmax attention; the reference for the others.

    Args:
        query: (..., L, E); key: (..., S, E); value: (..., S, Ev); one floating dtype, one device.
        is_causal: query ``i`` reads keys ``0..i`` (needs ``L <= S``).
        feature_map: ``"elu"`` (elu + 1), ``"relu"``, ``"identity"`` or a callable (..., E) -> (..., Dphi).
        normalize: divide by ``phi(q) . sum phi(k)`` (a kernel smoother); ``False`` gives the raw memory read.
        eps: added to the normalizer.

    Returns:
        (..., L, Ev), the dtype of ``query``.
    """
    eps = _check_common(is_causal, normalize, eps)
    _check_qkv(query, key, value, causal=is_causal)
    # (..., L, Dphi), (..., S, Dphi): a future key's NaN must not reach row i
    fq, fk, value, poison = _clean_features(_feature_map(feature_map), query, key, value, is_causal)
    check_fits(math.prod(fq.shape[:-1]) * fk.shape[-2] * fq.element_size(),
               f"linear_attention's (..., L, S) = {fmt_shape((*fq.shape[:-1], fk.shape[-2]))} kernel matrix "
               "(linear_attention_chunked or _recurrent need none)", fq.device)
    A = fq @ fk.transpose(-2, -1)  # (..., L, Dphi) @ (..., Dphi, S) -> (..., L, S)
    if is_causal:
        L, S = A.shape[-2:]
        A = A * torch.ones(L, S, dtype=torch.bool, device=A.device).tril()
    return _poisoned(_normalized(A @ value, A.sum(-1) if normalize else None, eps), poison)  # (..., L, Ev)


def linear_attention_recurrent(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = True,
    feature_map: FeatureMap = "elu", normalize: bool = True, eps: float = 1e-6,
    state: LinearAttentionState | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Linear attention as an RNN: for each key ``j`` in order, ``S += phi(k_j) v_j^T`` and ``z += phi(k_j)``;
    query ``i`` reads ``phi(q_i)^T S / phi(q_i)^T z``, after key ``i`` if causal, after all keys if not.

    The arguments are those of :func:`linear_attention`, plus ``state``: a state to continue from (decoding
    token by token), whose keys count as earlier than all of ``key``.

    Returns:
        ``(out (..., L, Ev), state)``: the state after every key, of fixed size ``(..., Dphi, Ev)`` + ``(..., Dphi)``.
    """
    eps = _check_common(is_causal, normalize, eps)
    _check_qkv(query, key, value, causal=is_causal)
    fq, fk = _features(_feature_map(feature_map), query, key)  # (..., L, Dphi), (..., S, Dphi)
    if state is None:
        S_ = fk.new_zeros(*fk.shape[:-2], fk.shape[-1], value.shape[-1])  # (..., Dphi, Ev)
        z = fk.new_zeros(*fk.shape[:-2], fk.shape[-1])  # (..., Dphi)
    else:
        if not isinstance(state, LinearAttentionState):
            raise TypeError(f"state must be a LinearAttentionState or None, got {type(state).__name__}")
        S_, z = state.S, state.z
        want = {"S": (*fk.shape[:-2], fk.shape[-1], value.shape[-1]), "z": (*fk.shape[:-2], fk.shape[-1])}
        for name, t in (("S", S_), ("z", z)):
            check_tensor(t, f"state.{name}")
            if tuple(t.shape) != want[name]:
                layout = "(..., Dphi, Ev)" if name == "S" else "(..., Dphi)"
                raise ValueError(f"state.{name} must have shape {want[name]} {layout} for these inputs, got "
                                 f"{fmt_shape(t.shape)}")
            check_same_dtype(**{"features": fk, f"state.{name}": t})
            check_same_device(**{"features": fk, f"state.{name}": t})
    outs = []

    def read(i: int) -> torch.Tensor:
        q = fq[..., i, :]  # (..., Dphi)
        num = (q.unsqueeze(-2) @ S_).squeeze(-2)  # (..., 1, Dphi) @ (..., Dphi, Ev) -> (..., Ev)
        den = (q * z).sum(-1) if normalize else None  # (...,)
        return _normalized(num, den, eps)

    for j in range(fk.shape[-2]):
        S_ = S_ + fk[..., j, :].unsqueeze(-1) * value[..., j, :].unsqueeze(-2)  # (..., Dphi, 1) * (..., 1, Ev)
        z = z + fk[..., j, :]
        if is_causal and j < fq.shape[-2]:
            outs.append(read(j))
    if not is_causal:
        outs = [read(i) for i in range(fq.shape[-2])]
    out = torch.stack(outs, dim=-2) if outs else value.new_zeros(*fq.shape[:-1], value.shape[-1])  # (..., L, Ev)
    return out, LinearAttentionState(S_, z)


def linear_attention_chunked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, chunk_size: int = 64,
                             feature_map: FeatureMap = "elu", normalize: bool = True,
                             eps: float = 1e-6) -> torch.Tensor:
    """Causal linear attention chunk by chunk: inside a chunk the parallel form (a (C, C) masked matrix), across
    chunks the state. O(L C) + O(L Dphi Ev) work; equals :func:`linear_attention` with ``is_causal=True``.
    Needs ``L == S`` (self-attention)."""
    eps = _check_common(True, normalize, eps)
    check_positive_int(chunk_size, "chunk_size")
    _check_qkv(query, key, value, causal=True)
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"linear_attention_chunked needs L == S, got query {fmt_shape(query.shape)} and key "
                         f"{fmt_shape(key.shape)}")
    # (..., L, Dphi): a later key's NaN must not reach an earlier row
    fq, fk, value, poison = _clean_features(_feature_map(feature_map), query, key, value, True)
    S_ = fk.new_zeros(*fk.shape[:-2], fk.shape[-1], value.shape[-1])  # (..., Dphi, Ev)
    z = fk.new_zeros(*fk.shape[:-2], fk.shape[-1])  # (..., Dphi)
    outs = []
    for a in range(0, fq.shape[-2], chunk_size):
        q, k, v = fq[..., a:a + chunk_size, :], fk[..., a:a + chunk_size, :], value[..., a:a + chunk_size, :]
        C = q.shape[-2]
        A = (q @ k.transpose(-2, -1)) * torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # (..., C, C)
        num = q @ S_ + A @ v  # (..., C, Ev)
        den = (q @ z.unsqueeze(-1)).squeeze(-1) + A.sum(-1) if normalize else None  # (..., C)
        outs.append(_normalized(num, den, eps))
        S_ = S_ + k.transpose(-2, -1) @ v  # (..., Dphi, C) @ (..., C, Ev)
        z = z + k.sum(-2)
    out = torch.cat(outs, dim=-2) if outs else value.new_zeros(*fq.shape[:-1], value.shape[-1])  # (..., L, Ev)
    return _poisoned(out, poison)


def delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, beta: float | torch.Tensor = 1.0, *,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule (Schlag et al., 2021; DeltaNet): for each key in order, ``S += beta (v - S k) k^T``, then
    query ``i`` reads ``S q_i`` (causal). With unit-norm keys and ``beta = 1`` the write replaces what ``S`` held
    for ``k`` by ``v``, instead of adding ``v`` on top (the plain linear memory, ``S += v k^T``).

    Args:
        query: (..., L, E).
        key: (..., L, E), used as given (normalize the keys for ``beta = 1``).
        value: (..., L, Ev).
        beta: the write strength in ``[0, 2]``: a float, or a tensor (..., L) of one per key.
        state: (..., Ev, E) to continue from, or ``None`` (zeros).

    Returns:
        ``(out (..., L, Ev), state (..., Ev, E))``.
    """
    _check_qkv(query, key, value, causal=True)
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"delta_rule needs L == S, got query {fmt_shape(query.shape)} and key "
                         f"{fmt_shape(key.shape)}")
    L = key.shape[-2]
    if isinstance(beta, torch.Tensor):
        if beta.shape != key.shape[:-1]:
            raise ValueError(f"beta as a tensor must have shape (..., L) = {fmt_shape(key.shape[:-1])}, got "
                             f"{fmt_shape(beta.shape)}")
        check_floating(beta, "beta")
        check_same_device(key=key, beta=beta)
        if beta.device.type != "meta" and not bool(((beta >= 0) & (beta <= 2)).all()):
            raise ValueError("beta must be in [0, 2] (beyond 2 the write overshoots and diverges; NaN is no "
                             f"strength), got values from {float(beta.min()):g} to {float(beta.max()):g}")
        betas = beta.to(key.dtype)
    else:
        b = check_positive_float(beta, "beta", allow_zero=True)
        if b > 2:
            raise ValueError(f"beta must be in [0, 2] (beyond 2 the write overshoots and diverges), got {beta!r}")
        betas = key.new_full(key.shape[:-1], b)
    if state is None:
        state = key.new_zeros(*key.shape[:-2], value.shape[-1], key.shape[-1])  # (..., Ev, E)
    else:
        check_tensor(state, "state")
        want = (*key.shape[:-2], value.shape[-1], key.shape[-1])
        if tuple(state.shape) != want:
            raise ValueError(f"state must have shape (..., Ev, E) = {want}, got {fmt_shape(state.shape)}")
        check_same_dtype(key=key, state=state)
        check_same_device(key=key, state=state)
    if L == 0:  # no token: an empty answer (..., 0, Ev) and the state unchanged (a copy, never the caller's own)
        return value.new_zeros(*query.shape[:-1], value.shape[-1]), state.clone()
    outs = []
    for j in range(L):
        k, v = key[..., j, :], value[..., j, :]  # (..., E), (..., Ev)
        err = v - (state @ k.unsqueeze(-1)).squeeze(-1)  # (..., Ev)
        state = state + betas[..., j, None, None] * err.unsqueeze(-1) * k.unsqueeze(-2)  # (..., Ev, E)
        outs.append((state @ query[..., j, :].unsqueeze(-1)).squeeze(-1))  # (..., Ev)
    return torch.stack(outs, dim=-2), state


# ----------------------------------------------------------------------------------------------------------
# The gated delta rule (Gated DeltaNet)


@dataclass
class GatedDeltaState:
    """The state of the gated delta rule after some tokens: ``S (..., Ev, E)``, the paper's ``S_t`` in
    ``R^{d_v x d_k}`` (the memory read as ``o = S q``). Its size does not depend on how many tokens it has seen."""

    S: torch.Tensor

    def nbytes(self) -> int:
        """Bytes the state occupies."""
        return self.S.numel() * self.S.element_size()


def _check_gated_delta(query: object, key: object, value: object, alpha: object, beta: object,
                       state: object, normalize_keys: object
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The public edge of both forms: shapes, dtypes, devices, finite inputs, ``alpha`` in (0, 1] and ``beta`` in
    [0, 1] (a tensor of one per token and head, or one number for all), the state's shape. Returns
    ``(alpha, beta, state.S or None)``, the gates as (..., L) tensors."""
    _check_qkv(query, key, value, causal=True)
    check_bool_flag(normalize_keys, "normalize_keys")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"the gated delta rule needs L == S (one query per written key), got query "
                         f"{fmt_shape(query.shape)} and key {fmt_shape(key.shape)}")
    gates = {}
    for name, g, low in (("alpha", alpha, "(0, 1]"), ("beta", beta, "[0, 1]")):
        if not isinstance(g, torch.Tensor):
            if isinstance(g, bool) or not isinstance(g, (int, float)):
                raise TypeError(f"{name} must be a tensor (..., L) or a float in {low}, got {type(g).__name__} "
                                f"{short_repr(g)}")
            g = key.new_full(key.shape[:-1], float(g))  # one number for every token and head
        check_floating(g, name)
        gates[name] = g
        if g.shape != key.shape[:-1]:
            raise ValueError(f"{name} must have shape (..., L) = {fmt_shape(key.shape[:-1])} (one per token and "
                             f"head), got {fmt_shape(g.shape)}")
        check_same_device(key=key, **{name: g})
        if g.device.type != "meta" and g.numel():
            inside = ((g > 0) if name == "alpha" else (g >= 0)) & (g <= 1)  # False for NaN
            if not bool(inside.all()):
                raise ValueError(f"{name} must be in {low} (alpha: the fraction of the state kept; beta: the write "
                                 f"strength), got values from {float(g.min()):g} to {float(g.max()):g}")
    if query.device.type != "meta" and not bool(all_finite(query, key, value, None)):
        raise ValueError("query, key and value must be finite for the gated delta rule (a NaN or inf written "
                         "into the state reaches every later token)")
    if state is None:
        return gates["alpha"], gates["beta"], None
    if not isinstance(state, GatedDeltaState):
        raise TypeError(f"state must be a GatedDeltaState or None, got {type(state).__name__}")
    check_tensor(state.S, "state.S")
    want = (*key.shape[:-2], value.shape[-1], key.shape[-1])
    if tuple(state.S.shape) != want:
        raise ValueError(f"state.S must have shape (..., Ev, E) = {want} for these inputs, got "
                         f"{fmt_shape(state.S.shape)}")
    check_same_dtype(key=key, **{"state.S": state.S})
    check_same_device(key=key, **{"state.S": state.S})
    return gates["alpha"], gates["beta"], state.S


def _gated_delta_recurrent(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_alpha: torch.Tensor,
                           beta: torch.Tensor, S: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (10) token by token, no checks (the layer calls this with ``log alpha`` from its decay)."""
    if S is None:
        S = key.new_zeros(*key.shape[:-2], value.shape[-1], key.shape[-1])  # (..., Ev, E)
    outs = []
    for t in range(key.shape[-2]):
        k, v = key[..., t, :], value[..., t, :]  # (..., E), (..., Ev)
        S = log_alpha[..., t, None, None].exp() * S  # the gate: alpha_t S_{t-1}
        err = v - (S @ k.unsqueeze(-1)).squeeze(-1)  # (..., Ev): v_t - alpha_t S_{t-1} k_t
        S = S + beta[..., t, None, None] * err.unsqueeze(-1) * k.unsqueeze(-2)  # (..., Ev, 1) * (..., 1, E)
        outs.append((S @ query[..., t, :].unsqueeze(-1)).squeeze(-1))  # o_t = S_t q_t, (..., Ev)
    out = torch.stack(outs, dim=-2) if outs else value.new_zeros(value.shape)  # (..., L, Ev)
    return out, S


def _gated_delta_chunked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_alpha: torch.Tensor,
                         beta: torch.Tensor, S: torch.Tensor | None, chunk_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise algorithm, no checks. Inside a chunk of C tokens, with ``G_r`` the cumulative sum of
    ``log alpha`` from the chunk's start (``gamma_r = exp(G_r)``), the state after its ``r``-th token is
    ``S^r = gamma_r S_0 + sum_{i <= r} (gamma_r / gamma_i) n_i k_i^T`` with the new values
    ``N = T (diag(beta) V) - T diag(beta gamma) K S_0^T`` and ``T = (I + A)^{-1}``,
    ``A_ri = beta_r (gamma_r / gamma_i) k_r . k_i`` for ``i < r`` (the UT transform, solved as one unit lower
    triangular system). Then ``O = diag(gamma) Q S_0^T + (Q K^T * Gamma) N`` and
    ``S_C = gamma_C S_0 + N^T diag(gamma_C / gamma) K``, ``Gamma_ri = gamma_r / gamma_i`` for ``i <= r``."""
    if S is None:
        S = key.new_zeros(*key.shape[:-2], value.shape[-1], key.shape[-1])  # (..., Ev, E)
    outs = []
    for a in range(0, key.shape[-2], chunk_size):
        q, k, v = query[..., a:a + chunk_size, :], key[..., a:a + chunk_size, :], value[..., a:a + chunk_size, :]
        b = beta[..., a:a + chunk_size]  # (..., C)
        C = k.shape[-2]  # the last chunk may be shorter
        G = log_alpha[..., a:a + chunk_size].cumsum(-1)  # (..., C): log gamma_r
        lower = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()  # i <= r
        diff = G.unsqueeze(-1) - G.unsqueeze(-2)  # (..., C, C): log(gamma_r / gamma_i)
        Gamma = torch.where(lower, diff, float("-inf")).exp()  # (..., C, C), 0 above the diagonal
        A = (b.unsqueeze(-1) * Gamma * (k @ k.transpose(-2, -1))).tril(-1)  # (..., C, C), strictly lower
        eye = torch.eye(C, dtype=k.dtype, device=k.device)
        rhs = torch.cat([b.unsqueeze(-1) * v, (b * G.exp()).unsqueeze(-1) * k], dim=-1)  # (..., C, Ev + E)
        UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # T @ rhs
        U, W = UW[..., :v.shape[-1]], UW[..., v.shape[-1]:]  # (..., C, Ev), (..., C, E)
        N = U - W @ S.transpose(-2, -1)  # (..., C, E) @ (..., E, Ev) -> (..., C, Ev)
        inter = G.exp().unsqueeze(-1) * (q @ S.transpose(-2, -1))  # (..., C, Ev): gamma_r S_0 q_r
        outs.append(inter + ((q @ k.transpose(-2, -1)) * Gamma) @ N)  # (..., C, C) @ (..., C, Ev)
        decay_to_end = (G[..., -1:] - G).exp()  # (..., C): gamma_C / gamma_i
        S = G[..., -1, None, None].exp() * S + N.transpose(-2, -1) @ (decay_to_end.unsqueeze(-1) * k)  # (..., Ev, E)
    out = torch.cat(outs, dim=-2) if outs else value.new_zeros(value.shape)  # (..., L, Ev)
    return out, S


def _gated_delta_inputs(key: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, normalize_keys: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = F.normalize(key, dim=-1) if normalize_keys else key
    return key, alpha.to(key.dtype).log(), beta.to(key.dtype)


def gated_delta_rule_recurrent(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, *,
    state: GatedDeltaState | None = None, normalize_keys: bool = True,
) -> tuple[torch.Tensor, GatedDeltaState]:
    """The gated delta rule token by token: the reference form (Yang, Kautz & Hatamizadeh, "Gated Delta Networks:
    Improving Mamba2 with Delta Rule", ICLR 2025, section 3.1, eq. (10))::

        S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T,        o_t = S_t q_t

    in the paper's convention: ``S_t`` is (Ev, E) = ``d_v x d_k`` and is read as ``S q``; ``alpha_t`` decays the
    whole memory, ``beta_t`` is the write strength of the delta rule. It is computed as
    ``S <- alpha_t S; S <- S + beta_t (v_t - S k_t) k_t^T`` (the same product, expanded). With ``alpha = 1`` it is
    :func:`delta_rule`; with ``beta = 0`` the memory only decays. No softmax, no normalizer, no query scale.

    Args:
        query: (..., L, E), used as given (the layer L2-normalizes it, as the paper's section 3.4 does).
        key: (..., L, E); L2-normalized here when ``normalize_keys`` (the paper's choice: with unit keys and
            ``beta`` in [0, 1] the transition ``I - beta k k^T`` has eigenvalues in [0, 1], so the state stays
            bounded). With ``normalize_keys=False`` the keys are used as given.
        value: (..., L, Ev); query, key and value of one floating dtype and device, finite.
        alpha: (..., L), the decay of each token and head, in (0, 1] (the paper has (0, 1); 1 keeps everything),
            or one float for all.
        beta: (..., L), the write strength, in [0, 1] (the paper's (0, 1), closed: a float32 sigmoid reaches both
            ends), or one float for all.
        state: the state to continue from (decoding), or ``None`` (zeros).
        normalize_keys: see ``key``.

    Returns:
        ``(out (..., L, Ev), state)``: the outputs and the state after the last token.
    """
    alpha, beta, S = _check_gated_delta(query, key, value, alpha, beta, state, normalize_keys)
    key, log_alpha, beta = _gated_delta_inputs(key, alpha, beta, normalize_keys)
    out, S = _gated_delta_recurrent(query, key, value, log_alpha, beta, S)
    return out, GatedDeltaState(S)


def gated_delta_rule_chunked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, *,
    chunk_size: int = 64, state: GatedDeltaState | None = None, normalize_keys: bool = True,
) -> tuple[torch.Tensor, GatedDeltaState]:
    """The gated delta rule chunk by chunk: equal to :func:`gated_delta_rule_recurrent` (same arguments), in
    O(L C (E + Ev)) + O(L E Ev) work of matrix products instead of L rank-1 updates.

    The algorithm is DeltaNet's chunkwise form (Yang et al., NeurIPS 2024, "Parallelizing Linear Transformers with
    the Delta Rule over Sequence Length": the WY representation of the product of the chunk's Householder-like
    transitions, eqs. (4)-(5) of the Gated DeltaNet paper, the UT transform that gives its factors by one triangular
    solve, eqs. (6)-(7), and the chunk's state and outputs, eqs. (8)-(9)) extended with the gates as in the Gated
    DeltaNet paper, section 3.3: inside a chunk, ``gamma_r`` = the product of ``alpha`` from the chunk's first token
    to its ``r``-th, the strictly lower matrix of the UT transform is ``diag(beta) (Gamma * K K^T)``, and the state
    entering the chunk reaches token ``r`` decayed by ``gamma_r``. Its output uses ``Q K^T * Gamma`` inside the
    chunk (the decay-aware mask of eq. (1)); the printed equation of section 3.3 writes the 0/1 mask ``M`` there,
    which drops the decay between two tokens of one chunk (NVlabs/GatedDeltaNet issue 15); the recurrence of eq.
    (10) needs ``Gamma``, as here. The decays are taken as differences of cumulative sums of ``log alpha``, so no
    ratio ``1 / gamma_i`` overflows.
    The arguments other than ``chunk_size`` are those of :func:`gated_delta_rule_recurrent`.

    Args:
        chunk_size: C >= 1, tokens per chunk; the last chunk holds ``L mod C`` tokens when C does not divide L.

    Returns:
        ``(out (..., L, Ev), state)``.
    """
    check_positive_int(chunk_size, "chunk_size")
    alpha, beta, S = _check_gated_delta(query, key, value, alpha, beta, state, normalize_keys)
    key, log_alpha, beta = _gated_delta_inputs(key, alpha, beta, normalize_keys)
    out, S = _gated_delta_chunked(query, key, value, log_alpha, beta, S, chunk_size)
    return out, GatedDeltaState(S)


# ----------------------------------------------------------------------------------------------------------
# Random features for the softmax kernel (Performer)


def softmax_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``exp(x . y)`` over the last dim: x (..., d), y (..., d) -> (...)."""
    _check_pair(x, y)
    return torch.exp((x * y).sum(-1))


def _check_pair(x: object, y: object) -> None:
    for name, t in (("x", x), ("y", y)):
        check_tensor(t, name)
        check_floating(t, name)
    check_same_dtype(x=x, y=y)
    check_same_device(x=x, y=y)
    if x.shape != y.shape:
        raise ValueError(f"x and y must have one shape (..., d), got x {fmt_shape(x.shape)} and y {fmt_shape(y.shape)}")


def draw_omega(num_features: int, dim: int, *, generator: torch.Generator | None = None,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``num_features`` i.i.d. standard normal directions, (m, d): the random projections of both estimators."""
    m = check_positive_int(num_features, "num_features")
    d = check_positive_int(dim, "dim")
    check_floating_dtype(dtype)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    check_fits(m * d * torch.empty((), dtype=dtype).element_size(),
               f"draw_omega's (num_features, dim) = ({m}, {d}) directions", "cpu")
    return torch.randn(m, d, generator=generator, dtype=dtype)


#: The two kinds of random features.
KINDS = ("positive", "trig")


def performer_features(x: torch.Tensor, omega: torch.Tensor, kind: str = "positive") -> torch.Tensor:
    """Random features of ``x`` whose dot products estimate ``exp(x . y)`` without bias.

    - ``"positive"``: ``exp(omega x - |x|^2 / 2) / sqrt(m)``, (..., m); every feature > 0;
    - ``"trig"``: ``exp(|x|^2 / 2) [sin(omega x), cos(omega x)] / sqrt(m)``, (..., 2m).

    Args:
        x: (..., d), floating. omega: (m, d) from :func:`draw_omega`. kind: ``"positive"`` or ``"trig"``.
    """
    check_tensor(x, "x")
    check_tensor(omega, "omega")
    check_floating(x, "x")
    if omega.dim() != 2 or omega.shape[1] != x.shape[-1]:
        raise ValueError(f"omega must be (m, d) with d = x.shape[-1] = {x.shape[-1]}, got {fmt_shape(omega.shape)}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {short_repr(kind)}")
    m = omega.shape[0]
    proj = x @ omega.to(x.dtype).T  # (..., d) @ (d, m) -> (..., m)
    half_sq = (x * x).sum(-1, keepdim=True) / 2  # (..., 1)
    if kind == "positive":
        return torch.exp(proj - half_sq) / math.sqrt(m)
    return torch.exp(half_sq) * torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) / math.sqrt(m)  # (..., 2m)


def performer_kernel_estimate(x: torch.Tensor, y: torch.Tensor, omega: torch.Tensor,
                              kind: str = "positive") -> torch.Tensor:
    """The estimate ``phi(x) . phi(y)`` of ``exp(x . y)``: x, y (..., d) -> (...)."""
    return (performer_features(x, omega, kind) * performer_features(y, omega, kind)).sum(-1)


def performer_variance(x: torch.Tensor, y: torch.Tensor, num_features: int, kind: str = "positive") -> torch.Tensor:
    """The closed-form variance of the ``m``-feature estimate of ``exp(x . y)`` (Choromanski et al., Lemma 2),
    with ``z = x + y``, ``delta = x - y`` and ``SM = exp(x . y)``:

    - positive: ``exp(|z|^2) SM^2 (1 - exp(-|z|^2)) / m``: small where the kernel is small (``z`` near 0);
    - trig: ``exp(|z|^2) SM^-2 (1 - exp(-|delta|^2))^2 / (2 m)``: small where ``x`` is near ``y``.

    x, y: (..., d) -> (...).
    """
    _check_pair(x, y)
    m = check_positive_int(num_features, "num_features")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {short_repr(kind)}")
    z2 = ((x + y) ** 2).sum(-1)
    sm = softmax_kernel(x, y)
    if kind == "positive":
        return torch.exp(z2) * sm**2 * (-torch.expm1(-z2)) / m
    d2 = ((x - y) ** 2).sum(-1)
    return torch.exp(z2) / sm**2 * torch.expm1(-d2) ** 2 / (2 * m)
