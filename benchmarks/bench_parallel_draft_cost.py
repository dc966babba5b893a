"""One drafting step's cost, EAGLE-3 (a forward per depth) vs P-EAGLE (one forward per block), untrained heads on
SmolLM2-135M, packed linears, 25 rounds with the cases interleaved (median): the prompt's catch-up is not
timed, each timed draft runs the one pending element and the whole tree. ``python benchmarks/bench_parallel_draft_cost.py``"""
import statistics
import time

import torch

from eaglekit.decode.drafters import EagleDrafter, ParallelDrafter, Tree, TreeSpec
from eaglekit.heads import HeadConfig, build_head
from eaglekit.target import load_target
from eaglekit.target.packed_linear import pack_linears

torch.set_num_threads(2)
t = load_target("smollm2-135m-instruct")
ids = t.chat_ids("Explain why the sky is blue in two sentences.")
out = t.forward(ids, layer_ids=tuple(t.default_taps))
heads = {}
for name, kind, layers, block in (("eagle3 L1", "eagle3", 1, 1), ("peagle L2 K4", "peagle", 2, 4), ("peagle L4 K4", "peagle", 4, 4), ("peagle L2 K8", "peagle", 2, 8)):
    torch.manual_seed(0)
    h = build_head(HeadConfig.from_target(t, kind=kind, num_layers=layers, block_size=block, draft_vocab_size=4096), t)
    pack_linears(h)
    heads[name] = h
def drafter(name, spec):
    h = heads[name]
    return (ParallelDrafter if h.parallel else EagleDrafter)(t, h, spec)
cases = {"eagle3 L1 chain4": ("eagle3 L1", TreeSpec(4, 1, 4)), "eagle3 L1 tree(4,4,16)": ("eagle3 L1", TreeSpec(4, 4, 16)),
         "peagle L2 K4 chain4": ("peagle L2 K4", TreeSpec(4, 1, 4)), "peagle L2 K4 tree(4,4,16)": ("peagle L2 K4", TreeSpec(4, 4, 16)),
         "peagle L4 K4 chain4": ("peagle L4 K4", TreeSpec(4, 1, 4)), "peagle L2 K8 chain8": ("peagle L2 K8", TreeSpec(8, 1, 8))}
T = ids.shape[1]
times = {k: [] for k in cases}
with torch.no_grad():
    for r in range(25):
        for k, (name, spec) in cases.items():
            d = drafter(name, spec)
            d.prefill(ids[:, :T - 2], out, int(ids[0, T - 2]))
            d.draft(8)  # prompt catch-up, not timed
            d.commit(Tree.empty(), [], int(ids[0, T - 1]), out, torch.tensor([T - 2]))  # one pending element
            t0 = time.perf_counter(); d.draft(8); times[k].append(time.perf_counter() - t0)
for k, v in times.items():
    print(f"{k}: median {1000 * statistics.median(v):.1f} ms (min {1000 * min(v):.1f})")
