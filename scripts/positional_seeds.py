"""Chapter 7's seed study: the "copy the previous token" probes retrained from more seeds.

The chapter trains each position method on seeds 0 to 4 in its own cells. This script repeats the chapter's
experiment (the same one-layer model, 400 Adam steps of 64 sequences of 12 tokens at learning rate 0.003, the
same test sets) for the sinusoidal, learned and rotary arms on more seeds, and records for each seed:
the accuracy at lengths 12, 24 and 48; at length 48, the sinusoidal and rotary models' accuracy with keys
restricted to the offsets seen in training, and to the right key plus unseen offsets (the chapter's two
masks); and, for the learned table, the smallest row norm and the standard deviation of the cosine similarity
along each diagonal (offsets 1 to 10). The model and the training loop are the chapter's, copied; the
chapter checks that the recorded seeds 0 to 4 agree with what it trains itself. Results go to
``attention_core/booktools/data/positional_seeds.json`` after every seed, so a partial study is usable.

    OMP_NUM_THREADS=1 python scripts/positional_seeds.py [--seeds 0 1 ... 24]

One thread, one seed at a time (three arms, about 2 s each on a free core).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attention_core as ac
from attention_core.positional import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding

OUT = Path(__file__).resolve().parents[1] / "attention_core" / "booktools" / "data" / "positional_seeds.json"
VOCAB, WIDTH, TRAIN_LEN = 10, 32, 12
LENGTHS = [12, 24, 48]


class PositionProbe(torch.nn.Module):
    # Token embedding (+ positions) -> one attention layer (2 heads) -> read-out (the chapter's model).
    def __init__(self, kind):
        super().__init__()
        self.tok, self.qkv, self.out = (torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, 3 * WIDTH),
                                        torch.nn.Linear(WIDTH, VOCAB))
        self.add = {"sinusoidal": SinusoidalPositionalEncoding(WIDTH, max_len=64),
                    "learned": LearnedPositionalEmbedding(TRAIN_LEN, WIDTH)}.get(kind)
        self.rope = RotaryEmbedding(WIDTH // 2, max_len=64) if kind == "RoPE" else None

    def forward(self, ids, attn_mask=None):  # ids (B, L) -> logits (B, L, VOCAB)
        x = self.tok(ids) if self.add is None else self.add(self.tok(ids))  # (B, L, D)
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)  # 3 x (B, 2, L, E)
        q, k = (q, k) if self.rope is None else self.rope(q, k)
        o = ac.scaled_dot_product_attention(q, k, v, attn_mask)  # (B, 2, L, E)
        o = o.transpose(1, 2).reshape(B, L, WIDTH)  # (B, L, D)
        return self.out(o + x)


def shift_batch(n, length, g):
    ids = torch.randint(0, VOCAB, (n, length), generator=g)
    return ids, ids.roll(1, dims=1)


def train_probe(kind, seed, steps=400):
    torch.manual_seed(seed)
    model, g = PositionProbe(kind), torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids, target = shift_batch(64, TRAIN_LEN, g)
        loss = F.cross_entropy(model(ids)[:, 1:].flatten(0, 1), target[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def accuracy(model, length, attn_mask=None):
    ids, target = shift_batch(500, length, torch.Generator().manual_seed(99))
    try:
        with torch.no_grad():
            return (model(ids, attn_mask)[:, 1:].argmax(-1) == target[:, 1:]).float().mean().item()
    except ValueError:
        return None


def diagonal_spreads(u):  # std of the cosine similarity along each diagonal, offsets 1 .. 10
    return [torch.diagonal(u @ u.T, d).std().item() for d in range(1, TRAIN_LEN - 1)]


def run_seed(seed: int) -> dict:
    off = torch.arange(48)[None, :] - torch.arange(48)[:, None]  # (48, 48): offset n - m
    seen = off.abs() <= TRAIN_LEN - 1
    unseen = (off == -1) | ((off.abs() >= TRAIN_LEN) & (off.abs() <= 2 * TRAIN_LEN - 2))
    row: dict = {"seed": seed}
    for kind in ["sinusoidal", "learned", "RoPE"]:
        model = train_probe(kind, seed)
        row[kind] = [accuracy(model, n) for n in LENGTHS]
        if kind == "learned":
            table = model.add.weight.detach()
            row["learned_min_row_norm"] = table.norm(dim=-1).min().item()
            row["learned_diagonal_sd"] = diagonal_spreads(F.normalize(table, dim=-1))
        else:
            row[f"{kind}_seen_48"] = accuracy(model, 48, seen)
            row[f"{kind}_unseen_48"] = accuracy(model, 48, unseen)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(25)))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = json.loads(args.out.read_text())["runs"] if args.out.is_file() else []
    done = {r["seed"] for r in runs}
    for seed in args.seeds:
        if seed in done:
            continue
        start = time.perf_counter()
        runs.append(run_seed(seed))
        runs.sort(key=lambda r: r["seed"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"about": __doc__.splitlines()[0], "runs": runs}, indent=1) + "\n")
        print(f"seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
