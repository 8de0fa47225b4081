"""Times of chosen paged_attention_decode shapes (bf16, block 16, the database's choices), for A/B comparisons
of two trees: ``python3 hipkern/bench/pa_shapes.py LABEL [--set 64:1|8kv|all]`` prints, per mode, one line of
microseconds: "eager" as the benchmark times (events around each call, rotating inputs, median) and "graph"
(CUDA-graph replay). Run as a file under each tree's PYTHONPATH (and its own HIPKERN_JIT_DIR), alternating,
to time each tree's hipkern with the same shapes; `--header` prints the shapes' names."""
from __future__ import annotations

import argparse

SHAPES = {  # name: (context lengths, q heads, kv heads, head size)
    "64:1": [(f"{b}x{c}", [c] * b, 64, 1, 256) for b, c in ((1, 256), (1, 2048), (8, 256), (16, 256), (32, 256),
                                                          (8, 2048), (16, 2048), (32, 2048), (64, 4096), (1, 32768))],
    "8kv": [(f"{b}x{c}", [c] * b, 64, 8, 128) for b, c in ((1, 256), (8, 256), (16, 256), (32, 256), (1, 2048),
                                                         (8, 2048), (16, 2048), (32, 2048))],
}
SHAPES["all"] = SHAPES["64:1"] + SHAPES["8kv"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label")
    ap.add_argument("--set", default="64:1", choices=sorted(SHAPES))
    ap.add_argument("--header", action="store_true", help="print the shapes' names first")
    a = ap.parse_args(argv)
    import hipkern
    from hipkern.bench.paged_attention import make_inputs
    from hipkern.testing import run_graphtest, run_perftest

    shapes = SHAPES[a.set]
    if a.header:
        print("label  mode  " + " ".join(f"{s[0]:>10s}" for s in shapes))
    eager, graph = [], []
    for _, lens, hq, hkv, d in shapes:
        q, k, v, bt, cl = make_inputs(lens, hq, hkv, d)
        eager.append(run_perftest(hipkern.paged_attention_decode, q, k, v, bt, cl, num_iters=60)[1])
        graph.append(run_graphtest(hipkern.paged_attention_decode, q, k, v, bt, cl, num_iters=12)[1])
        del q, k, v, bt, cl
    for mode, us in (("eager", eager), ("graph", graph)):
        print(f"{a.label:6s} {mode} " + " ".join(f"{x:10.2f}" for x in us), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
