"""Chapter 13's side run: the MiniLM attribution comparison on the chapter's set and seven more sets of 32.

The chapter ranks raw attention of each layer, rollout, flow, gradient x input and integrated gradients
against leave-one-out, for six probe scores, on one set of 32 sentences. This script repeats that on the
chapter's set and seven others: A and B are new sentences; C and D are new sentences written by another reader
as a fresh check (after the chapter's observations were made on the first six sets); R1, R2 and R3 are random
draws of 32 from the 96 sentences of the chapter's set, A and B. For each set it prints each method's mean
Spearman per probe, how many probes it is above the chance range for (300 random rankings per probe), and the
rollout counts (against layer 1, the best layer, layers 3 and 6). It also computes Abnar and Zuidema's
layer-matched methods (their Table 1): for each layer l, rollout and flow through layers 1 to l (``rollout@l``,
``flow@l``; ``rollout`` and ``flow`` are those through all six), and counts the word pieces whose flow is below
their cap out of layer 1 (the column sum of ``(A_1 + I) / 2`` over the real positions). Integrated gradients use
8 steps, as in the chapter: an approximation whose attributions miss the score gap by a median share of 0.08 to
0.47 of it on the chapter's set, so the chapter quotes no counts of this script's ``ig`` row.

The results go to ``attention_core/booktools/data/minilm_sets.json`` (the chapter reads them): per set and
probe, each method's mean Spearman and the chance range's top, and the per-sentence Spearman of raw attention
of layers 3 and 6, rollout and flow (for the pooled intervals the chapter prints).

    OMP_NUM_THREADS=1 python scripts/minilm_sets.py

About two minutes per set on one thread of a shared two-core Xeon.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from attention_core import explain
from attention_core.models.bert import mean_pool
from attention_core.pretrained import load_minilm

OUT = Path(__file__).resolve().parents[1] / "attention_core" / "booktools" / "data" / "minilm_sets.json"
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
SET_C = ["the bread was fresh and warm", "a boring show with bad jokes", "the beer here is flat and warm",
         "my bike needs new tyres", "the ferry left an hour early", "they lost the game at home",
         "this chair feels very cheap", "we liked the small mountain hut", "a bad book with a nice cover",
         "the band played all night", "nobody read his long letter", "a smart and lively comic",
         "the kitchen smelled of gas", "wind broke the old fence", "the finale was loud and empty",
         "what a pretty old church", "the rice was far too sticky", "her latest film is a gem",
         "the nurse was very kind", "our street is full of shops", "the meeting tired everyone",
         "a lovely poem about the sea", "the juice tasted odd", "fans cheered the goalkeeper",
         "the new phone is worse than the old", "cold milk every evening", "the dancers seemed tired",
         "a quiet walk along the shore", "the heater kept failing", "a bright and hopeful story",
         "the speech made no point", "the worst trip of the year"]
SET_D = ["that song always makes me cry", "a dreadful and tedious lecture", "the pancakes were light and sweet",
         "our neighbour plays loud drums", "the concert started very late", "he fixed the roof in a day",
         "this tablet charges too slowly", "we adored the tiny museum", "a weak script with strong acting",
         "the chef cooked a fine dinner", "no one liked the new logo", "a gripping and clever thriller",
         "the carpet was old and torn", "fog delayed every train", "the opening was flat and long",
         "what a splendid summer day", "the curry was much too hot", "his first painting is lovely",
         "the guide was rather rude", "the shelf is full of books", "the sermon bored the town",
         "a moving film about a father", "the wine tasted sour", "the crowd loved the drummer",
         "the film is better than the trailer", "warm socks on a winter night", "the singers sounded off",
         "a pleasant hike up the hill", "the lift broke again", "a kind and patient doctor",
         "the answer made little sense", "the greatest game of the season"]


def sets() -> dict[str, list[str]]:
    pool = SET_A + SET_B + PAGE
    return {"page": PAGE, "A": SET_A, "B": SET_B, "C": SET_C, "D": SET_D,
            **{f"R{k}": random.Random(k).sample(pool, 32) for k in (1, 2, 3)}}


def _values(v: torch.Tensor) -> list:
    return [None if math.isnan(r) else round(r, 4) for r in v.tolist()]


def run_set(lm, name: str, texts: list[str], probes: dict[str, torch.Tensor]) -> dict:
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
    for n in range(1, 7):                                               # Abnar and Zuidema's layer-matched pair
        methods[f"rollout@{n}"] = torch.einsum("bi,bij->bj", pooled, explain.attention_rollout(att[:n]))
        methods[f"flow@{n}"] = explain.attention_flow(att[:n], output=pooled, attention_mask=mask)
    methods["rollout"], methods["flow"] = methods["rollout@6"], methods["flow@6"]
    same = explain.spearman(methods["flow"], methods["L1"], words).min().item()
    cap1 = (explain.residual_attention(att[0].mean(1).double()) * mask[:, :, None]).sum(1)   # (B, L)
    below = ((cap1 - methods["flow"]) > 1e-4) & words                  # flow under its layer-1 cap
    print(name, f"flow vs L1: min Spearman {same:.3f}; flow below its layer-1 cap for {int(below.sum())} of "
          f"{int(words.sum())} word pieces, in {int(below.any(1).sum())} sentences", flush=True)
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[float]] = {}
    above: dict[str, list[bool]] = {}
    per: dict[str, list[list]] = {}
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
            each = explain.spearman(v, loo, words)                      # (32,) one per sentence
            r = each.nanmean().item()
            rows.setdefault(k, []).append(r)
            above.setdefault(k, []).append(r > hi)
            if k in ("L3", "L6", "rollout", "flow"):
                per.setdefault(k, []).append(_values(each))
        rows.setdefault("chance_hi", []).append(hi)
    for k, v in rows.items():
        tail = "" if k == "chance_hi" else f"above {sum(above[k])}/6"
        print(name, f"{k:10s}", " ".join(f"{r:+.2f}" for r in v), tail, flush=True)
    best = [max(rows[f"L{n}"][i] for n in range(1, 7)) for i in range(6)]
    print(name, "rollout>L1 on", sum(rows["rollout"][i] > rows["L1"][i] for i in range(6)),
          "; L3>rollout on", sum(rows["L3"][i] > rows["rollout"][i] for i in range(6)),
          "; L6>rollout on", sum(rows["L6"][i] > rows["rollout"][i] for i in range(6)),
          "; L6>flow on", sum(rows["L6"][i] > rows["flow"][i] for i in range(6)),
          "; rollout<best layer on", sum(rows["rollout"][i] < best[i] for i in range(6)),
          "; flow<best layer on", sum(rows["flow"][i] < best[i] for i in range(6)), flush=True)
    return {"texts": texts, "flow_vs_L1_min_spearman": round(same, 4), "word_pieces": int(words.sum()),
            "flow_below_cap1": int(below.sum()), "sentences_flow_below_cap1": int(below.any(1).sum()),
            "mean": {k: [round(r, 4) for r in v] for k, v in rows.items()},
            "above": {k: v for k, v in above.items()}, "per_sentence": per}


def main() -> None:
    torch.set_num_threads(1)
    lm = load_minilm()
    lm.model.eval()
    probes = {t: lm.encode(t).embeddings[0] for t in PROBES}
    record = {"probes": PROBES, "independent": ["page", "A", "B", "C", "D"], "sets": {}}
    for name, texts in sets().items():
        record["sets"][name] = run_set(lm, name, texts, probes)
        OUT.write_text(json.dumps(record, indent=1) + "\n")            # after every set: a partial run is usable


if __name__ == "__main__":
    main()
