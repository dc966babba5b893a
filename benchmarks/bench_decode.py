"""Decode benchmark: τ, tokens/s and speedup vs plain, side by side with transformers' baselines.

Same as ``eaglekit bench``; key=value overrides as there. Examples (CPU numbers take long; the machine
must be quiet for final numbers):

    python benchmarks/bench_decode.py target=smollm2-135m-instruct head=runs/smollm2-eagle3/final
    python benchmarks/bench_decode.py target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \
        dataset=humaneval prompts=20 assistant_tokens=[3,5,8]
Writes benchmarks/results/decode/<target>-<drafter>-<dataset>.json and .png.
"""
import argparse
import sys

from eaglekit.bench import cli as bench

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None)
    p.add_argument("overrides", nargs="*", default=[])
    sys.exit(bench.run(p.parse_args()))
