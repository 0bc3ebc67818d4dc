"""Causal through a block mask against the chunked backend's own ``is_causal``, the two alone (no dense SDPA
between them, whose gigabytes of scores evict the caches), interleaved rounds, wall and process CPU time.

    python benchmarks/recheck_flex_causal.py 16384 fwd+bwd 5

appends one record to ``benchmarks/results/flex_causal_recheck.json``. fp32, B = 1, H = 4, E = 64, one thread.
"""

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch  # noqa: E402
from bench_chunked_cpu import git_revision, interleaved  # noqa: E402
from bench_flex import calls_for, mods  # noqa: E402

from attention_core.backends.chunked import chunked_attention  # noqa: E402
from attention_core.flex_attention import create_block_mask, flex_attention  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    L, mode, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    bm = create_block_mask(mods(L)["causal"], None, None, L, L)
    prov = {"flex": lambda q, k, v: flex_attention(q, k, v, block_mask=bm),
            "chunked_is_causal": lambda q, k, v: chunked_attention(q, k, v, is_causal=True)}
    calls = {p: calls_for(f, mode, L) for p, f in prov.items()}
    load0 = os.getloadavg()
    wall, cpu = interleaved(calls, rounds)
    res = {"L": L, "mode": mode, "rounds": rounds, "wall_ms": wall, "cpu_ms": cpu, "loadavg": [load0, os.getloadavg()],
           "flex_over_is_causal": statistics.median(wall["flex"]) / statistics.median(wall["chunked_is_causal"]),
           "cpu_flex_over_is_causal": statistics.median(cpu["flex"]) / statistics.median(cpu["chunked_is_causal"])}
    print(json.dumps({k: v for k, v in res.items() if k not in ("wall_ms", "cpu_ms")}))
    res["revision"] = git_revision()
    out = ROOT / "benchmarks" / "results" / "flex_causal_recheck.json"
    records = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(records + [res], indent=1) + "\n")
    print("wall", {k: [round(x) for x in v] for k, v in wall.items()})
    print("cpu", {k: [round(x) for x in v] for k, v in cpu.items()})


if __name__ == "__main__":
    main()
