"""Looking inside a trained encoder: attention entropy, attention received, gradient x input, a head explorer.

These work on what :class:`~attention_core.bert.BertEncoder` returns (per-layer attention weights
(B, H, L, L) and an ``attention_mask`` (B, L)), and are what chapter 10 plots for MiniLM:

- :func:`attention_entropy`: how spread out each head's weights are, averaged over the real queries;
- :func:`attention_received`: how much weight each token receives, averaged over heads and real queries;
- :func:`value_contributions`: the vector each token adds per unit of weight, per head (a weight on a
  token whose vector is short changes little);
- :func:`gradient_x_input`: a gradient-based attribution on the word embeddings, to set beside attention
  (attention weights are not an explanation of the output);
- :class:`HeadExplorer`: a layer/head selector over the attention maps of one sentence, which also carries
  a kernel-free version (a slider over the layers, every head drawn) for the static site.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import ipywidgets as widgets
import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure

from attention_core._checks import check_tensor, fmt_shape
from attention_core.bert import BertEncoder, BertOutput
from attention_core.functional import weights_entropy
from attention_core.modules import MultiHeadAttention
from attention_core.viz import HEATMAP_CMAP, figure_to_png, plot_attention

__all__ = [
    "HeadExplorer",
    "attention_entropy",
    "attention_received",
    "gradient_x_input",
    "head_explorer",
    "value_contributions",
]


def _check_weights(attentions: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Stack per-layer weights (B, H, L, L) into (N, B, H, L, L), checking them against the mask."""
    if isinstance(attentions, torch.Tensor) or len(attentions) == 0:
        raise TypeError("attentions must be a non-empty sequence of (B, H, L, L) tensors, one per layer")
    check_tensor(attention_mask, "attention_mask")
    for i, a in enumerate(attentions):
        check_tensor(a, f"attentions[{i}]")
        if a.dim() != 4 or a.shape[-1] != a.shape[-2] or (a.shape[0], a.shape[-1]) != tuple(attention_mask.shape):
            raise ValueError(
                f"attentions[{i}] must be (B, H, L, L) with (B, L) = {tuple(attention_mask.shape)} "
                f"(the attention_mask), got {fmt_shape(a.shape)}"
            )
    return torch.stack([a.detach() for a in attentions])


def attention_entropy(attentions: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of each head's attention rows, over the real queries of a batch.

    ``H(p) = -sum_k p_k log p_k`` for one query's weights over the keys (0 log 0 = 0): 0 when the query
    attends to one key only, ``log n`` when it spreads evenly over ``n`` real keys.

    Args:
        attentions: one (B, H, L, L) tensor per layer (N layers).
        attention_mask: (B, L), True/1 on real tokens; padding queries are left out.

    Returns:
        (N, H) float tensor.
    """
    w = _check_weights(attentions, attention_mask).float()  # (N, B, H, L, L)
    ent = weights_entropy(w)  # (N, B, H, L, L) -> (N, B, H, L): one entropy per query row
    m = attention_mask.bool().to(w.device)[None, :, None, :]  # (B, L) -> (1, B, 1, L)
    return (ent * m).sum(dim=(1, 3)) / m.sum(dim=(1, 3))  # (N, H)


def attention_received(weights: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Weight each key receives, averaged over heads and over the real queries: (B, H, L, L) -> (B, L).

    Each row sums to 1 over the real keys (padding keys receive 0).
    """
    w = _check_weights([weights], attention_mask)[0].float()  # (B, H, L, L)
    m = attention_mask.bool().to(w.device).float()  # (B, L)
    per_query = w.mean(1)  # (B, H, L, S) -> (B, L, S)
    return (per_query * m[:, :, None]).sum(1) / m.sum(1, keepdim=True)  # (B, S)


def value_contributions(attention: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """What each token can add to the attention output, per head: ``f_hj = (x_j W_V^h + b_V^h) W_O^h``.

    The output of multi-head self-attention for query ``i`` is ``b_O + sum_h sum_j alpha_hij f_hj``, so a
    weight ``alpha_hij`` matters only as much as the vector ``f_hj`` it multiplies is long: a large weight on
    a token whose ``f`` is short moves the output little.

    Args:
        attention: a self-attention module with ``num_kv_heads == num_heads``.
        x: (B, L, D), the module's input.

    Returns:
        (B, H, L, D) vectors, without gradient.
    """
    if attention.num_kv_heads != attention.num_heads:
        raise ValueError("attention must have num_kv_heads == num_heads (no grouped-query attention here)")
    check_tensor(x, "x")
    if x.dim() != 3 or x.shape[-1] != attention.embed_dim:
        raise ValueError(f"x must be (B, L, D) with D = {attention.embed_dim}, got {fmt_shape(x.shape)}")
    B, L, D = x.shape
    H, E = attention.num_heads, attention.head_dim
    with torch.no_grad():
        v = attention.v_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        w_o = attention.out_proj.weight.view(D, H, E)  # (D, H * E) -> (D, H, E)
        return torch.einsum("bhle,dhe->bhld", v, w_o)  # (B, H, L, D)


def gradient_x_input(
    model: BertEncoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score: Callable[[BertOutput], torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradient x input on the word embeddings: how much each token's word vector moves a scalar score.

    ``a_i = sum_d (d score / d e_id) e_id`` where ``e_i`` is token ``i``'s word embedding (before positions
    and LayerNorm are added). A first-order estimate of the score change if the word vector were removed;
    positive values push the score up.

    Args:
        model: the encoder (put in eval mode by the caller; its parameters get no gradient).
        input_ids: (B, L) token ids.
        attention_mask: (B, L), True/1 on real tokens.
        score: maps the model's :class:`~attention_core.bert.BertOutput` to a scalar tensor.

    Returns:
        ``(attributions, score)``: (B, L) attributions (0 on padding) and the score's value.
    """
    if not callable(score):
        raise TypeError(f"score must be a callable BertOutput -> scalar tensor, got {type(score).__name__}")
    emb = model.embeddings.word_embeddings(input_ids).detach().requires_grad_()  # (B, L) -> (B, L, D)
    out = model(inputs_embeds=emb, attention_mask=attention_mask)
    value = score(out)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"score must return a scalar tensor, got {value!r:.80}")
    (grad,) = torch.autograd.grad(value, emb)
    attributions = (grad * emb).sum(-1).detach() * attention_mask.to(emb.dtype)  # (B, L, D) -> (B, L)
    return attributions, value.detach()


# ------------------------------------------------------------------------------------------ explorer


class HeadExplorer(widgets.VBox):
    """A layer and head selector over one sentence's attention maps, with a static version for the site.

    Args:
        attentions: one (H, L, L) tensor per layer, for one sentence (padding removed).
        tokens: the L tokens (labels of rows and columns).
        layer: initial layer, 1-based (layer 1 is the first encoder layer).
        head: initial head, 0-based.

    Attributes:
        layer, head: the two ``IntSlider`` selectors.
        summary: a ``Label`` describing the map shown (entropy, strongest link).
        image: the ``Image`` holding the current figure.
    """

    def __init__(self, attentions: Sequence[torch.Tensor], tokens: Sequence[str], layer: int = 1, head: int = 0):
        self.weights = torch.stack([a.detach().float().cpu() for a in attentions])  # (N, H, L, L)
        N, H, L, S = self.weights.shape
        if L != S or len(tokens) != L:
            raise ValueError(f"attentions must be (H, L, L) per layer with L = len(tokens) = {len(tokens)}, "
                             f"got {fmt_shape(self.weights.shape[1:])}")
        if not (1 <= layer <= N and 0 <= head < H):
            raise ValueError(f"layer must be in [1, {N}] and head in [0, {H - 1}], got layer={layer}, head={head}")
        self.tokens = list(tokens)
        self.layer = widgets.IntSlider(value=layer, min=1, max=N, description="layer", continuous_update=False)
        self.head = widgets.IntSlider(value=head, min=0, max=H - 1, description="head", continuous_update=False)
        self.summary = widgets.Label()
        self.image = widgets.Image(format="png")
        super().__init__(children=[widgets.HBox([self.layer, self.head]), self.summary, self.image])
        self.layer.observe(self.redraw, names="value")
        self.head.observe(self.redraw, names="value")
        self.redraw()

    def describe(self, layer: int, head: int) -> str:
        """One line about a head's map: its mean entropy and its largest weight."""
        w = self.weights[layer - 1, head]  # (L, L)
        ent = attention_entropy([w[None, None]], torch.ones(1, w.shape[0], dtype=torch.bool))[0, 0]
        q, k = divmod(int(w.argmax()), w.shape[1])
        return (f"layer {layer}, head {head}: mean entropy {float(ent):.2f} nats "
                f"(uniform: {math.log(w.shape[1]):.2f}); largest weight {float(w[q, k]):.2f}, "
                f"from {self.tokens[q]!r} to {self.tokens[k]!r}")

    def figure(self, layer: int, head: int) -> Figure:
        """The map of one head, off-screen."""
        fig = Figure(figsize=(5.2, 4.2), layout="constrained")
        plot_attention(self.weights[layer - 1, head], self.tokens, self.tokens, ax=fig.subplots(),
                       vmax=1.0, title=f"layer {layer}, head {head}")
        return fig

    def grid(self, layer: int, cols: int = 4) -> Figure:
        """Every head of one layer as one mosaic image (a frame of the static version).

        One ``imshow`` of the H maps tiled ``cols`` to a row (white gaps between them), which renders far
        faster than H separate axes.
        """
        W = self.weights[layer - 1].numpy()  # (H, L, L)
        H, L, _ = W.shape
        rows, step = -(-H // cols), L + 1  # one blank row/column between maps
        canvas = np.full((rows * step - 1, cols * step - 1), np.nan)  # (rows*(L+1)-1, cols*(L+1)-1)
        for h in range(H):
            r, c = divmod(h, cols)
            canvas[r * step : r * step + L, c * step : c * step + L] = W[h]
        fig = Figure(figsize=(2.1 * cols + 1.2, 2.1 * rows + 0.6))
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps[HEATMAP_CMAP].with_extremes(bad="white")  # the gaps between maps
        im = ax.imshow(canvas, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        for h in range(H):
            r, c = divmod(h, cols)
            ax.text(c * step + (L - 1) / 2, r * step - 0.7, f"head {h}", ha="center", va="bottom", fontsize=8)
        ax.set_yticks([r * step + i for r in range(rows) for i in range(L)])
        ax.set_yticklabels(self.tokens * rows, fontsize=6)
        ax.set_xticks([c * step + i for c in range(cols) for i in range(L)])
        ax.set_xticklabels(self.tokens * cols, fontsize=6, rotation=90)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"layer {layer}: every head (rows: queries, columns: keys)", pad=16)
        fig.colorbar(im, ax=ax, shrink=0.6, label="weight")
        return fig

    def redraw(self, *_: Any) -> None:
        """Redraw for the current selectors."""
        layer, head = int(self.layer.value), int(self.head.value)
        self.summary.value = self.describe(layer, head)
        self.image.value = figure_to_png(self.figure(layer, head))

    def static_html(self, dpi: int = 80) -> str:
        """The kernel-free version: a slider over the layers, each frame showing every head."""
        from attention_core.static import frame_slider

        layers: List[int] = list(range(1, self.weights.shape[0] + 1))
        frames = [self.grid(layer) for layer in layers]
        return frame_slider(frames, layers, label="layer", initial=int(self.layer.value) - 1, dpi=dpi,
                            alt=f"attention maps of every head for: {' '.join(self.tokens)}").markup

    def _repr_mimebundle_(self, **kwargs: Any) -> Optional[dict]:
        # ipywidgets 8 displays through this method; 7.x uses _ipython_display_ (no static version there).
        parent = getattr(super(), "_repr_mimebundle_", None)
        data = parent(**kwargs) if parent is not None else None
        if data is None:
            return data
        return {**data, "text/html": self.static_html()}


def head_explorer(
    attentions: Sequence[torch.Tensor], tokens: Sequence[str], layer: int = 1, head: int = 0
) -> HeadExplorer:
    """A :class:`HeadExplorer` for one sentence: ``attentions`` holds one (H, L, L) tensor per layer."""
    return HeadExplorer(attentions, tokens, layer=layer, head=head)
