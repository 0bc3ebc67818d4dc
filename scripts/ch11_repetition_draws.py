"""Chapter 11's repetition study on twelve draws: how often sampled text loops, pooled over 60 samples.

Cell 18's code (five prompts of 64 validation characters, one seed each, 200 characters sampled at temperature
0.8, the share of generated characters that complete an earlier 10-character string) on twelve draws of
prompt starts and seeds: the page's own draw first, then eleven more. It prints each draw and the pooled counts
that cell 19 quotes; nothing is written.

    OMP_NUM_THREADS=1 python scripts/ch11_repetition_draws.py

About two minutes on one thread. The recorded run (two-core Xeon, shared) ended with: pooled 60 samples:
model share > 0.3 in 12, model max 0.83, model mean 0.164, text mean 0.023, text max 0.14, plain-crop model
> 0 in 0; no sample above 0.3 on 5 of the 12 draws.
"""

from __future__ import annotations

import torch

from attention_core.models import language_model as lm
from attention_core.shakespeare import data as shakespeare
from attention_core.shakespeare import train as shakespeare_train

#: (prompt starts, first seed): the page's draw, then eleven more
DRAWS = [(range(0, 25000, 5000), 0), (range(500, 100000, 20000), 100), (range(4000, 100000, 19000), 200),
         (range(11000, 100000, 17000), 300), (range(1500, 100000, 21000), 400), (range(9000, 100000, 18000), 500),
         (range(2500, 100000, 19500), 600), (range(7000, 100000, 18500), 700), (range(13000, 100000, 16500), 800),
         (range(3300, 100000, 20500), 900), (range(15000, 100000, 17500), 1000), (range(6100, 100000, 19800), 1100)]


def main() -> None:
    torch.set_num_threads(1)
    corpus = shakespeare.load_corpus()
    vocab = corpus.vocab
    model, _ = shakespeare_train.load_or_train_language_model()
    plain, _ = shakespeare_train.load_or_train_language_model(recipe=shakespeare_train.ATTENTION_KINDS["MHA"])

    def repeated_share(ids: torch.Tensor, start: int, n: int = 10) -> float:
        s = vocab.decode(ids)
        return sum(s[t - n + 1 : t + 1] in s[:t] for t in range(start + n - 1, len(s))) / (len(s) - start - n + 1)

    pooled = {"model": [], "plain": [], "text": []}
    quiet_draws = 0
    for d, (starts, seed0) in enumerate(DRAWS):
        share = {"model": [], "plain": [], "text": []}
        for k, s in enumerate(list(starts)[:5]):
            prompt = corpus.val[s : s + 64][None]
            for name, m in (("model", model), ("plain", plain)):
                out = lm.generate(m, prompt, 200, temperature=0.8, generator=torch.Generator().manual_seed(seed0 + k))
                share[name].append(repeated_share(out[0], 64))
            share["text"].append(repeated_share(corpus.val[s : s + 264], 64))
        for name, v in share.items():
            pooled[name] += v
        quiet_draws += max(share["model"]) <= 0.3
        print(f"draw {d} starts {list(starts)[:5]} seeds {seed0}..{seed0 + 4}: model "
              + " ".join(f"{x:.2f}" for x in share["model"]) + " | text "
              + " ".join(f"{x:.2f}" for x in share["text"]) + f" | plain max {max(share['plain']):.2f}", flush=True)
    m, t, p = pooled["model"], pooled["text"], pooled["plain"]
    print(f"pooled {len(m)} samples: model share > 0.3 in {sum(x > 0.3 for x in m)}, model max {max(m):.2f}, "
          f"model mean {sum(m) / len(m):.3f}, text mean {sum(t) / len(t):.3f}, text max {max(t):.2f}, "
          f"plain-crop model > 0 in {sum(x > 0 for x in p)}; no sample above 0.3 on {quiet_draws} of the "
          f"{len(DRAWS)} draws")


if __name__ == "__main__":
    main()
