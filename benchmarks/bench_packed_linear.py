"""Target forward over m new tokens on a cached prefix: aten ``linear`` vs oneDNN pre-packed linears.

    python benchmarks/bench_packed_linear.py --target smollm2-135m-instruct --threads 2

Prints one row per kernel (median ms of ``--repeats`` forwards, timed by ``decode.cost.verify_costs``)
and the largest logit difference.
"""
from __future__ import annotations

import argparse

import torch

from eaglekit.decode.cost import verify_costs
from eaglekit.target import load_target
from eaglekit.target.packed_linear import pack_linears

SIZES = (1, 2, 4, 8, 13, 16, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    prefix = torch.randint(10, target.vocab_size - 1, (1, args.prefix), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = target.forward(prefix, layer_ids=()).logits
        aten = verify_costs(target, prefix, args.repeats, SIZES)
        n = pack_linears(target.model)
        packed = verify_costs(target, prefix, args.repeats, SIZES)
        got = target.forward(prefix, layer_ids=()).logits
    print(f"{args.target}, {torch.get_num_threads()} threads, prefix {args.prefix}, {n} linears packed")
    print("| verified tokens m | " + " | ".join(map(str, SIZES)) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    for name, costs in (("aten `linear`, ms", aten), ("packed, ms", packed)):
        print(f"| {name} | " + " | ".join(f"{costs[m] * 1000:.1f}" for m in SIZES) + " |")
    print(f"max |logit difference| over the prefix: {float((got - ref).abs().max()):.2e}; "
          f"argmax agreement {float((got.argmax(-1) == ref.argmax(-1)).float().mean()):.4f}")


if __name__ == "__main__":
    main()
