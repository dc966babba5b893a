"""``eaglekit bench``: τ, tokens/s and speedup vs plain decoding, measured side by side in one run.

Modules: ``cli`` (the config and the run: every method on every prompt, repeated) → ``methods`` (how each
method decodes: our loop with or without a drafter, transformers' baselines) and ``report`` (summaries,
the JSON and its table) → ``plots`` (PNGs); ``prompts`` (MT-bench / HumanEval questions); ``batch``
(``batch_sizes=``: plain batched decoding vs drafting per batch size) with ``theory`` (expected speedups,
memory).
"""
