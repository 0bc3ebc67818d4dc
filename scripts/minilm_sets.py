"""Chapter 13's side run: the MiniLM attribution comparison on five more sets of 32 short sentences.

The chapter ranks raw attention of each layer, rollout, flow, gradient x input and integrated gradients
against leave-one-out, for six probe scores, on one set of 32 sentences. This script repeats that on five
other sets: A and B are new sentences; R1, R2 and R3 are random draws of 32 from the 96 sentences of the
chapter's set, A and B. For each set it prints each method's mean Spearman per probe, how many probes it is
above the chance range for (300 random rankings per probe), and the rollout counts (against layer 1, the best
layer and layer 3). Integrated gradients use 8 steps, as in the chapter: an approximation whose attributions
miss the score gap by a median share of 0.08 to 0.47 of it on the chapter's set, so the chapter quotes no
counts of this script's `ig` row.

    OMP_NUM_THREADS=1 python scripts/minilm_sets.py

About two minutes per set on one thread of a shared two-core Xeon.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from attention_core import explain
from attention_core.models.bert import mean_pool
from attention_core.pretrained import load_minilm

PROBES = ["a great film", "a terrible film", "a long boring trip", "my favourite song", "the weather today",
          "a delicious meal"]
PAGE = ["the movie was wonderful and moving", "a dull plot with weak actors", "the food here is cold and bland",
        "my cat sleeps all day long", "the train arrived two hours late", "she won the race by a mile",
        "this phone battery dies too fast", "we loved the quiet beach town", "an awful film with a great cast",
        "the music made the whole evening", "nobody laughed at his jokes", "a brilliant and funny script",
        "the hotel room smelled of smoke", "rain ruined our picnic again", "the ending felt rushed and cheap",
        "what a lovely little theatre", "the soup was far too salty", "his new novel is a masterpiece",
        "the bus driver was very rude", "our garden is full of roses", "the lecture bored everyone",
        "a charming story about two sisters", "the coffee tasted burnt", "kids adored the clown",
        "the sequel is worse than the original", "fresh bread every morning", "the actors seemed lost",
        "a gorgeous view from the top", "the wifi kept dropping", "an honest and touching film",
        "the plot made no sense", "the best concert of the year"]
SET_A = ["the film was slow and dull", "a warm and funny comedy", "the pizza arrived cold", "my dog chases every ball",
         "the flight was delayed again", "he scored in the final minute", "this laptop runs very hot",
         "we enjoyed the calm lake", "a terrible movie with a fine score", "the singer moved the crowd",
         "nobody came to the party", "a clever and witty play", "the room was dirty and loud",
         "snow closed the roads today", "the story dragged on forever", "what a sweet little cafe",
         "the steak was tough and dry", "her debut album is superb", "the waiter ignored us",
         "the park is full of trees", "the talk put me to sleep", "a tender tale of two friends",
         "the tea was too bitter", "children loved the puppet show", "the remake is better than the book",
         "hot soup on a cold night", "the cast looked bored", "a stunning view of the sea", "the printer jammed twice",
         "a sincere and moving drama", "the jokes fell flat", "the finest meal of my life"]
SET_B = ["i hated every minute of it", "the best pasta in town", "the bus was packed and slow",
         "birds sing outside my window", "the match ended in a draw", "a bold and beautiful film",
         "the screen cracked on day one", "our trip to rome was perfect", "the acting was wooden",
         "a cozy inn by the river", "the plot twist was silly", "the crowd cheered all night",
         "the cake was dry and stale", "a thrilling race to the end", "the service was painfully slow",
         "my sister bakes great bread", "the show lost its charm", "an elegant and quiet hotel",
         "the noise kept us awake", "the garden smells of lilac", "the film bored the children",
         "a heartfelt song about home", "the milk had gone sour", "fans adored the new album",
         "the dialogue was clumsy", "sunny days by the pool", "the camera work was shaky", "a delightful evening out",
         "the update broke my phone", "a wise and gentle teacher", "the sequel made no sense",
         "the happiest day of the year"]


def sets() -> dict[str, list[str]]:
    pool = SET_A + SET_B + PAGE
    return {"A": SET_A, "B": SET_B, **{f"R{k}": random.Random(k).sample(pool, 32) for k in (1, 2, 3)}}


def run_set(lm, name: str, texts: list[str], probes: dict[str, torch.Tensor]) -> None:
    enc = lm.model
    tok = lm.tokenize(texts)
    ids, mask = tok.input_ids, tok.attention_mask
    words = mask.clone()
    words[:, 0] = False
    words[torch.arange(len(texts)), mask.sum(1) - 1] = False            # rank word pieces, not [CLS]/[SEP]
    x = enc.embeddings.word_embeddings(ids).detach()
    with torch.no_grad():
        att = enc(ids, attention_mask=mask, need_weights=True).attentions
    pooled = mask.double() / mask.sum(1, keepdim=True)
    methods = {f"L{n + 1}": torch.einsum("bi,bij->bj", pooled, a.mean(1).double()) for n, a in enumerate(att)}
    methods["rollout"] = torch.einsum("bi,bij->bj", pooled, explain.attention_rollout(att))
    methods["flow"] = explain.attention_flow(att, output=pooled, attention_mask=mask)
    same = explain.spearman(methods["flow"], methods["L1"], words).min().item()
    print(name, f"flow vs L1: min Spearman {same:.3f}", flush=True)
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[float]] = {}
    above: dict[str, list[bool]] = {}
    for probe in probes.values():
        def score(x, keep=mask, probe=probe):
            out = enc(inputs_embeds=x, attention_mask=keep)
            return F.normalize(mean_pool(out.last_hidden_state, keep), dim=-1) @ probe
        loo = explain.leave_one_out(lambda keep: score(x, keep), mask, words).abs()
        ranked = dict(methods, gxi=explain.gradient_x_input(score, x).abs(),
                      ig=explain.integrated_gradients(score, x, steps=8).abs())
        chance = torch.stack([explain.spearman(torch.rand(loo.shape, generator=g, dtype=torch.float64), loo, words)
                              .mean() for _ in range(300)])
        hi = chance.quantile(0.975).item()
        for k, v in ranked.items():
            r = explain.spearman(v, loo, words).mean().item()
            rows.setdefault(k, []).append(r)
            above.setdefault(k, []).append(r > hi)
        rows.setdefault("chance_hi", []).append(hi)
    for k, v in rows.items():
        tail = "" if k == "chance_hi" else f"above {sum(above[k])}/6"
        print(name, f"{k:9s}", " ".join(f"{r:+.2f}" for r in v), tail, flush=True)
    best = [max(rows[f"L{n}"][i] for n in range(1, 7)) for i in range(6)]
    print(name, "rollout>L1 on", sum(rows["rollout"][i] > rows["L1"][i] for i in range(6)),
          "; L3>rollout on", sum(rows["L3"][i] > rows["rollout"][i] for i in range(6)),
          "; rollout<best layer on", sum(rows["rollout"][i] < best[i] for i in range(6)),
          "; flow<best layer on", sum(rows["flow"][i] < best[i] for i in range(6)), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    lm = load_minilm()
    lm.model.eval()
    probes = {t: lm.encode(t).embeddings[0] for t in PROBES}
    for name, texts in sets().items():
        run_set(lm, name, texts, probes)


if __name__ == "__main__":
    main()
