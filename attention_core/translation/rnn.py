"""RNN encoder-decoders: without attention (Cho et al., 2014), Bahdanau's (2014/2015) and Luong's (2015).

Every model here shares one encoder, a bidirectional GRU whose outputs ``h_j = [h_j^fwd; h_j^bwd]``
(B, S, 2H) are the keys and values of the attention, and one interface for its decoder:

- ``init_state(enc)`` -> the decoder's state before the first step;
- ``step(y_prev, state, enc, t)`` -> ``(logits (B, V), new state, weights (B, S) or None)``.

The decoders differ in what each step reads:

- :class:`PlainDecoder` (no attention): the context is the encoder's final state, the same at every step,
  one fixed-length vector whatever the source's length (the bottleneck Bahdanau et al. conjectured; attention
  gives each step a context of its own instead);
- :class:`BahdanauDecoder`: ``c_t`` from :class:`~attention_core.models.rnn_attention.AdditiveAttention` queried with
  the previous state ``s_{t-1}``; then ``s_t = GRU([E y_{t-1}; c_t], s_{t-1})``;
- :class:`LuongDecoder`: ``h_t = GRU([E y_{t-1}; h~_{t-1}], h_{t-1})`` (input feeding), then ``c_t`` from
  :class:`~attention_core.models.rnn_attention.LuongAttention` queried with the current ``h_t``, and the attentional
  state ``h~_t = tanh(W_c [c_t; h_t])`` from which the next token is predicted.

:class:`Seq2Seq` runs a decoder under teacher forcing (``forward``) or greedily (:func:`greedy_decode`), and
:func:`build_rnn_model` makes any of them from a plain dict, which is what checkpoints store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attention_core._checks import check_bool_flag, check_instance, check_int, check_positive_int, fmt_shape, short_repr
from attention_core.masks import padding_mask
from attention_core.models.rnn_attention import AdditiveAttention, LuongAttention
from attention_core.training.modes import eval_mode
from attention_core.translation.data import BOS_ID, EOS_ID, PAD_ID, check_source_batch
from attention_core.translation.protocol import EncoderDecoder

__all__ = [
    "BahdanauDecoder",
    "DecodeResult",
    "Encoder",
    "SourceEncoding",
    "LuongDecoder",
    "PlainDecoder",
    "Seq2Seq",
    "alignment_scores",
    "build_rnn_model",
    "count_parameters",
    "greedy_decode",
]

State = Any


@dataclass
class SourceEncoding:
    """What the encoder hands the decoder.

    Attributes:
        outputs: (B, S, Dk) every source position's state (zeros at padding).
        final: (B, Dk) the summary: last forward state and first backward state, concatenated.
        mask: (B, S) bool, True at real source positions.
    """

    outputs: torch.Tensor
    final: torch.Tensor
    mask: torch.Tensor


def _check_ids(x: object, name: str, high: int, *, rank: int, layout: str, low: int = 0,
               kinds: Tuple[torch.dtype, ...] = (torch.int64, torch.int32, torch.int16, torch.int8)) -> None:
    """Raise ``TypeError`` unless ``x`` is an integer tensor, ``ValueError`` unless it has ``rank`` dimensions and
    its entries lie in ``[low, high)`` (one min/max over it)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in kinds:
        what = f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else f"{type(x).__name__} {short_repr(x)}"
        raise TypeError(f"{name} must be an integer tensor {layout} ({', '.join(map(str, kinds))}), got {what}")
    if x.dim() != rank:
        raise ValueError(f"{name} must be {layout}, got shape {fmt_shape(x.shape)}")
    if x.numel() and (int(x.min()) < low or int(x.max()) >= high):
        raise ValueError(f"{name} must hold values in [{low}, {high - 1}], got min {int(x.min())}, "
                         f"max {int(x.max())}")


class Encoder(nn.Module):
    """Embedding + (bidirectional) GRU over padded sources; padding never enters the final state.

    Args:
        vocab_size: source vocabulary size (id 0 is ``<pad>``).
        embed_dim: embedding size.
        hidden_dim: GRU size per direction; outputs have ``2 * hidden_dim`` features when bidirectional.
        bidirectional: read the source both ways (Bahdanau) or left to right only.
    """

    def __init__(self, vocab_size: int, embed_dim: int, hidden_dim: int, bidirectional: bool = True) -> None:
        super().__init__()
        for name, size in (("vocab_size", vocab_size), ("embed_dim", embed_dim), ("hidden_dim", hidden_dim)):
            check_positive_int(size, name)
        check_bool_flag(bidirectional, "bidirectional")
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD_ID)
        self.rnn = nn.GRU(embed_dim, hidden_dim, batch_first=True, bidirectional=bidirectional)
        self.output_dim = hidden_dim * (2 if bidirectional else 1)

    def forward(self, src: torch.Tensor, src_valid_lens: torch.Tensor) -> SourceEncoding:
        """Encode (B, S) ids whose first ``src_valid_lens[b]`` entries are real.

        Raises:
            TypeError: ``src`` or ``src_valid_lens`` is not an integer tensor.
            ValueError: ``src`` is not (B, S), ``src_valid_lens`` not (B,), a length outside ``1..S`` or an id
                outside ``0..vocab_size - 1``.
        """
        _check_ids(src, "src", self.embedding.num_embeddings, rank=2, layout="(B, S)", kinds=(torch.int64, torch.int32))
        B, S = src.shape
        _check_ids(src_valid_lens, "src_valid_lens", S + 1, rank=1, layout=f"(B,) = ({B},)", low=1)
        if src_valid_lens.shape[0] != B:
            raise ValueError(f"src_valid_lens must be (B,) = ({B},) lengths, got shape "
                             f"{fmt_shape(src_valid_lens.shape)}")
        packed = pack_padded_sequence(self.embedding(src), src_valid_lens.cpu(), batch_first=True,
                                      enforce_sorted=False)
        out, h_n = self.rnn(packed)  # h_n: (directions, B, H)
        outputs, _ = pad_packed_sequence(out, batch_first=True, total_length=S)  # (B, S, Dk)
        final = torch.cat(list(h_n), dim=-1)  # (directions, B, H) -> (B, Dk)
        return SourceEncoding(outputs, final, padding_mask(src_valid_lens, S))


class _GRUDecoder(nn.Module):
    """Shared parts: target embedding, a bridge from the encoder's summary to the first state."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden_dim: int, enc_dim: int, input_dim: int) -> None:
        super().__init__()
        for name, size in (("vocab_size", vocab_size), ("embed_dim", embed_dim), ("hidden_dim", hidden_dim),
                           ("enc_dim", enc_dim)):
            check_positive_int(size, name)
        self.vocab_size, self.hidden_dim, self.enc_dim = vocab_size, hidden_dim, enc_dim
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD_ID)
        self.bridge = nn.Linear(enc_dim, hidden_dim)  # s_0 = tanh(W_init h_final)
        self.cell = nn.GRUCell(input_dim, hidden_dim)

    def _check_enc(self, enc: SourceEncoding) -> None:
        if enc.outputs.shape[-1] != self.enc_dim:
            raise ValueError(f"encoder outputs have {enc.outputs.shape[-1]} features but the decoder was built "
                             f"with enc_dim={self.enc_dim}")


class PlainDecoder(_GRUDecoder):
    """No attention: every step reads the same context, the encoder's final state (one fixed-length vector).

    ``s_t = GRU([E y_{t-1}; c], s_{t-1})``, logits ``= W_o [s_t; c; E y_{t-1}]`` with ``c = h_final``.
    """

    def __init__(self, vocab_size: int, embed_dim: int, hidden_dim: int, enc_dim: int) -> None:
        super().__init__(vocab_size, embed_dim, hidden_dim, enc_dim, embed_dim + enc_dim)
        self.out = nn.Linear(hidden_dim + enc_dim + embed_dim, vocab_size)

    def init_state(self, enc: SourceEncoding) -> torch.Tensor:
        self._check_enc(enc)
        return torch.tanh(self.bridge(enc.final))  # (B, Dk) -> (B, H)

    def step(self, y_prev: torch.Tensor, state: torch.Tensor, enc: SourceEncoding, t: int
             ) -> Tuple[torch.Tensor, torch.Tensor, None]:
        emb = self.embedding(y_prev)  # (B,) -> (B, E)
        s = self.cell(torch.cat([emb, enc.final], -1), state)  # (B, E + Dk) -> (B, H)
        return self.out(torch.cat([s, enc.final, emb], -1)), s, None  # -> (B, V)


class BahdanauDecoder(_GRUDecoder):
    """Bahdanau's decoder: attend with the previous state, then update the state with the context.

    ``c_t = Attn(s_{t-1}, h)``, ``s_t = GRU([E y_{t-1}; c_t], s_{t-1})``, logits ``= W_o [s_t; c_t; E y_{t-1}]``
    (the paper's maxout deep-output layer is simplified to one linear layer).

    Args:
        vocab_size: target vocabulary size.
        embed_dim: target embedding size.
        hidden_dim: decoder state size.
        enc_dim: encoder output size.
        attn_dim: hidden size of the additive score (default ``hidden_dim``).
    """

    def __init__(self, vocab_size: int, embed_dim: int, hidden_dim: int, enc_dim: int,
                 attn_dim: Optional[int] = None) -> None:
        super().__init__(vocab_size, embed_dim, hidden_dim, enc_dim, embed_dim + enc_dim)
        if attn_dim is not None:
            check_positive_int(attn_dim, "attn_dim")
        self.attention = AdditiveAttention(hidden_dim, enc_dim, attn_dim or hidden_dim)
        self.out = nn.Linear(hidden_dim + enc_dim + embed_dim, vocab_size)

    def init_state(self, enc: SourceEncoding) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(s_0, W_k h)``: the first state and the keys' projection, computed once per sentence."""
        self._check_enc(enc)
        s0 = torch.tanh(self.bridge(enc.final))  # (B, Dk) -> (B, H)
        return s0, self.attention.project_key(enc.outputs)  # (B, S, Dk) -> (B, S, A)

    def step(self, y_prev: torch.Tensor, state: Tuple[torch.Tensor, torch.Tensor], enc: SourceEncoding, t: int
             ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        s_prev, keys = state
        emb = self.embedding(y_prev)  # (B,) -> (B, E)
        context, weights = self.attention(s_prev, enc.outputs, attn_mask=enc.mask,
                                          projected_key=keys)  # query s_{t-1}: (B, Dk), (B, S)
        s = self.cell(torch.cat([emb, context], -1), s_prev)  # (B, E + Dk) -> (B, H)
        return self.out(torch.cat([s, context, emb], -1)), (s, keys), weights  # -> (B, V)


class LuongDecoder(_GRUDecoder):
    """Luong's decoder: update the state first, then attend with it; input feeding.

    ``h_t = GRU([E y_{t-1}; h~_{t-1}], h_{t-1})``, ``c_t = Attn(h_t, h)``, ``h~_t = tanh(W_c [c_t; h_t])``,
    logits ``= W_s h~_t``. Without ``input_feeding`` the GRU reads ``E y_{t-1}`` only.

    Args:
        vocab_size, embed_dim, hidden_dim, enc_dim: as for :class:`BahdanauDecoder`.
        score, mode, window: passed to :class:`~attention_core.models.rnn_attention.LuongAttention`.
        input_feeding: feed ``h~_{t-1}`` into the next step.
    """

    def __init__(self, vocab_size: int, embed_dim: int, hidden_dim: int, enc_dim: int, score: str = "general",
                 mode: str = "global", window: int = 2, input_feeding: bool = True) -> None:
        check_bool_flag(input_feeding, "input_feeding")
        super().__init__(vocab_size, embed_dim, hidden_dim, enc_dim,
                         embed_dim + (hidden_dim if input_feeding else 0))
        self.input_feeding = input_feeding
        self.attention = LuongAttention(hidden_dim, enc_dim, score=score, mode=mode, window=window)
        self.combine = nn.Linear(enc_dim + hidden_dim, hidden_dim, bias=False)  # W_c
        self.out = nn.Linear(hidden_dim, vocab_size)  # W_s

    def init_state(self, enc: SourceEncoding) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(h_0, h~_0 = 0, projected keys)``; the keys' projection is computed once per sentence."""
        self._check_enc(enc)
        h = torch.tanh(self.bridge(enc.final))  # (B, Dk) -> (B, H)
        return h, torch.zeros_like(h), self.attention.project_key(enc.outputs)

    def step(self, y_prev: torch.Tensor, state: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], enc: SourceEncoding,
             t: int) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        h_prev, h_tilde_prev, keys = state
        x = self.embedding(y_prev)  # (B,) -> (B, E)
        if self.input_feeding:
            x = torch.cat([x, h_tilde_prev], -1)  # (B, E + H)
        h = self.cell(x, h_prev)  # (B, H)
        context, weights = self.attention(h, enc.outputs, attn_mask=enc.mask, step=t,
                                          projected_key=keys)  # query h_t: (B, Dk), (B, S)
        h_tilde = torch.tanh(self.combine(torch.cat([context, h], -1)))  # (B, Dk + H) -> (B, H)
        return self.out(h_tilde), (h, h_tilde, keys), weights  # -> (B, V)


class Seq2Seq(nn.Module):
    """An encoder and a decoder, run with teacher forcing.

    Args:
        encoder: an :class:`Encoder`.
        decoder: a :class:`PlainDecoder`, :class:`BahdanauDecoder` or :class:`LuongDecoder`.
        config: the dict :func:`build_rnn_model` made it from (stored in checkpoints); optional.
    """

    def __init__(self, encoder: Encoder, decoder: nn.Module, config: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        check_instance(encoder, Encoder, "encoder", "an Encoder")
        check_instance(decoder, _GRUDecoder, "decoder", "a PlainDecoder, BahdanauDecoder or LuongDecoder")
        if encoder.output_dim != decoder.enc_dim:
            raise ValueError(f"encoder output size {encoder.output_dim} differs from the decoder's "
                             f"enc_dim={decoder.enc_dim}")
        self.encoder, self.decoder = encoder, decoder
        self.config = dict(config or {})

    @property
    def has_attention(self) -> bool:
        return not isinstance(self.decoder, PlainDecoder)

    def encode(self, src: torch.Tensor, src_valid_lens: torch.Tensor) -> SourceEncoding:
        """Validate the source and encode it."""
        check_source_batch(src, src_valid_lens)
        return self.encoder(src, src_valid_lens)

    def forward(self, src: torch.Tensor, src_valid_lens: torch.Tensor, tgt_in: torch.Tensor
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Teacher forcing: logits for every target position given the gold previous tokens.

        Args:
            src: (B, S) int64 source ids; src_valid_lens: (B,) their lengths.
            tgt_in: (B, T) int64 decoder inputs, ``<bos> y_1 .. y_{T-1}``.

        Returns:
            ``(logits, weights)``: (B, T, V) and (B, T, S), or ``None`` for the plain decoder.
        """
        enc = self.encode(src, src_valid_lens)
        if tgt_in.dim() != 2 or tgt_in.shape[0] != src.shape[0]:
            raise ValueError(f"tgt_in must be (B={src.shape[0]}, T), got shape {fmt_shape(tgt_in.shape)}")
        state = self.decoder.init_state(enc)
        logits, weights = [], []
        for t in range(tgt_in.shape[1]):
            step_logits, state, w = self.decoder.step(tgt_in[:, t], state, enc, t)
            logits.append(step_logits)
            weights.append(w)
        stacked = torch.stack(weights, 1) if self.has_attention else None  # T x (B, S) -> (B, T, S)
        return torch.stack(logits, 1), stacked  # T x (B, V) -> (B, T, V)


@dataclass
class DecodeResult:
    """Greedy decoding's output.

    Attributes:
        tokens: (B, T) int64 predicted ids, ``<pad>`` after each row's ``<eos>``.
        lengths: (B,) number of tokens before ``<eos>`` (T when it never came).
        weights: (B, T, S) alignment weights of every step, or ``None`` without attention.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]


@torch.no_grad()
def greedy_decode(model: EncoderDecoder, src: torch.Tensor, src_valid_lens: torch.Tensor, max_len: int = 20
                  ) -> DecodeResult:
    """Decode by taking the most likely token at each step, until every row emitted ``<eos>``."""
    check_int(max_len, "max_len", low=1)
    with eval_mode(model):  # every submodule's mode back afterwards, also on error
        return _greedy_decode(model, src, src_valid_lens, max_len)


def _greedy_decode(model: EncoderDecoder, src: torch.Tensor, src_valid_lens: torch.Tensor, max_len: int
                   ) -> DecodeResult:
    enc = model.encode(src, src_valid_lens)
    B = src.shape[0]
    state = model.decoder.init_state(enc)
    y = torch.full((B,), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    tokens, weights = [], []
    for t in range(max_len):
        logits, state, w = model.decoder.step(y, state, enc, t)
        y = logits.argmax(-1)  # (B, V) -> (B,)
        tokens.append(y.masked_fill(done, PAD_ID))
        weights.append(w)
        done = done | (y == EOS_ID)
        if bool(done.all()):
            break
    out = torch.stack(tokens, 1)  # T x (B,) -> (B, T)
    is_eos = out == EOS_ID
    lengths = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], out.shape[1],
                                                                                   dtype=torch.long))
    stacked = torch.stack(weights, 1) if model.has_attention else None  # T x (B, S) -> (B, T, S)
    return DecodeResult(out, lengths.long(), stacked)


@torch.no_grad()
def alignment_scores(model: Seq2Seq, src: torch.Tensor, src_valid_lens: torch.Tensor, tgt_in: torch.Tensor,
                   return_queries: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Raw alignment scores ``e_tj`` (before any softmax or window) under teacher forcing: (B, T, S).

    The query of step t is what each decoder really asks with: the previous state ``s_{t-1}`` for
    :class:`BahdanauDecoder`, the current ``h_t`` for :class:`LuongDecoder`. Padding positions get scores too
    (the masks are applied later); ignore them. With ``return_queries`` also return the queries, (B, T, Dq).
    """
    check_instance(model, Seq2Seq, "model", "a Seq2Seq")
    if not model.has_attention or not isinstance(model.decoder, (BahdanauDecoder, LuongDecoder)):
        raise ValueError(f"model must have a Bahdanau or Luong decoder, got {type(model.decoder).__name__}")
    enc = model.encode(src, src_valid_lens)
    dec = model.decoder
    state = dec.init_state(enc)
    out, queries = [], []
    for t in range(tgt_in.shape[1]):
        query = state[0]  # s_{t-1} (Bahdanau), overwritten by h_t below for Luong
        _, state, _ = dec.step(tgt_in[:, t], state, enc, t)
        if isinstance(dec, LuongDecoder):
            query = state[0]  # h_t
        out.append(dec.attention.scores(query[:, None], enc.outputs, state[-1])[:, 0])  # (B, S)
        queries.append(query)
    scores = torch.stack(out, 1)  # T x (B, S) -> (B, T, S)
    return (scores, torch.stack(queries, 1)) if return_queries else scores  # T x (B, Dq) -> (B, T, Dq)


MODEL_KINDS = ("plain", "bahdanau", "luong")


def build_rnn_model(config: Dict[str, Any]) -> Seq2Seq:
    """Build a :class:`Seq2Seq` from a plain dict (what checkpoints store).

    Keys: ``kind`` (``"plain"``, ``"bahdanau"`` or ``"luong"``), ``src_vocab_size``, ``tgt_vocab_size``,
    ``embed_dim``, ``hidden_dim`` (encoder size per direction; the decoder state has ``2 * hidden_dim``);
    for ``"luong"`` also ``score``, ``mode``, ``window`` and ``input_feeding``. Parameters are initialised from
    ``seed`` (default 0) without touching the global RNG.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    kind = config.get("kind")
    if kind not in MODEL_KINDS:
        raise ValueError(f"config['kind'] must be one of {MODEL_KINDS}, got {kind!r}")
    missing = [k for k in ("src_vocab_size", "tgt_vocab_size", "embed_dim", "hidden_dim") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}")
    E, H = config["embed_dim"], config["hidden_dim"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.get("seed", 0))
        encoder = Encoder(config["src_vocab_size"], E, H, bidirectional=True)
        D, V = encoder.output_dim, config["tgt_vocab_size"]
        if kind == "plain":
            decoder: nn.Module = PlainDecoder(V, E, D, D)
        elif kind == "bahdanau":
            decoder = BahdanauDecoder(V, E, D, D)
        else:
            decoder = LuongDecoder(V, E, D, D, score=config.get("score", "general"),
                                   mode=config.get("mode", "global"), window=config.get("window", 2),
                                   input_feeding=config.get("input_feeding", True))
    return Seq2Seq(encoder, decoder, config)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    check_instance(model, nn.Module, "model", "an nn.Module")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
