"""The bench's report: summaries over repeats (with the speedup the measured acceptance and step costs
predict), speedup per prompt category, acceptance per depth, the JSON file (with its PNGs) and a markdown
table (with the drafter's memory beside the target's); the paired bootstrap the benchmarks/ scripts share."""
from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

from eaglekit.bench.plots import plot, plot_acceptance, plot_categories
from eaglekit.bench.theory import expectations, memory_lines
from eaglekit.fileio import write_text


def rates(stats) -> list[float | None]:
    """DecodeStats.acceptance_per_depth, the one definition: the rate at depth d is
    P(the depth-d draft token is accepted | depths 1..d-1 were accepted and the tree reached depth d),
    i.e. #steps accepting >= d drafted tokens / #steps accepting >= d-1 whose tree reached depth d.
    A conditional rate, so not monotone in d. None where no step qualified (NaN is not JSON)."""
    return [None if math.isnan(r) else r for r in stats.acceptance_per_depth]



def paired_bootstrap(stat, n: int, n_boot: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """(``stat`` on all ``n`` items, its bootstrap 95% interval): ``stat`` takes a list of item indices (e.g.
    one head's pooled τ minus another's on the same prompts) and is recomputed on ``n_boot`` resamples of
    ``n`` items drawn with replacement, a compared pair staying together (paired). The interval is the
    resamples' 2.5% and 97.5% points. Seeded: calls with the same ``n``, ``n_boot`` and ``seed`` draw the
    same resamples, so several arms compared with one base are resampled alike."""
    rng = random.Random(seed)
    boots = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(n_boot))
    return stat(list(range(n))), boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]

def speedup_per_category(records: list[dict]) -> dict[str, float]:
    """category -> median over repeats of ours' tokens/s over plain's, totals over the category's
    prompts (= plain seconds / ours seconds when both emit the same tokens, as greedy decoding does)."""
    out = {}
    for cat in dict.fromkeys(r["category"] for r in records):
        rs = [r for r in records if r["category"] == cat]
        repeats = range(len(rs[0]["plain"]["seconds"]))
        out[cat] = statistics.median(_tokens_per_s(rs, "ours", k) / _tokens_per_s(rs, "plain", k)
                                     for k in repeats)
    return out


def _tokens_per_s(records: list[dict], method: str, rep: int) -> float:
    return sum(r[method]["tokens"][rep] for r in records) / sum(r[method]["seconds"][rep] for r in records)


def summarise(runs: dict, pooled: dict | None = None, gamma: int | None = None) -> dict:
    """Per method: medians over repeats (tokens/s, τ), its speedup over plain's median tokens/s and, for the
    methods of our loop (``pooled``: their DecodeStats over every prompt and repeat), the decode phase's
    speedup (paired: the median of each repeat's ratio) beside the speedup its measured acceptance and step
    costs predict (``theory.expectations``; Leviathan's too for ``ours`` drafting a chain of ``gamma``)."""
    pooled = pooled or {}
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    plain_step = _median(runs["plain"], "verify_s_per_forward")
    out = {}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        same = [r["identical_to_plain"] for r in rs if r.get("identical_to_plain")]
        out[name] = {"tokens_per_s": tps, "speedup_vs_plain": tps / plain,
                     "tau": statistics.median(taus) if taus else None,
                     "identical_to_plain": ", ".join(same) if same else None, "repeats": rs}
        if name in pooled and plain_step is not None:
            out[name].update(_predicted(rs, runs["plain"], pooled[name], plain_step,
                                        gamma if name == "ours" else None))
    assisted = [n for n in out if n.startswith("hf_assisted_")]
    if assisted:
        best = max(assisted, key=lambda n: out[n]["tokens_per_s"])
        out[best]["best_of_assisted"] = True
    return out


def _median(rs: list[dict], key: str) -> float | None:
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _predicted(rs: list[dict], plain_rs: list[dict], stats, plain_step: float, gamma: int | None) -> dict:
    """The decode-phase speedup a method measured (prefill left out, as the formulas leave it out) and the
    one its acceptance and step costs predict."""
    draft_s, verify_s = _median(rs, "draft_s_per_forward"), _median(rs, "verify_s_per_forward")
    if draft_s is None or verify_s is None:
        return {}
    decode = [r["decode_tokens_per_s"] / p["decode_tokens_per_s"] for r, p in zip(rs, plain_rs)
              if r.get("decode_tokens_per_s") and p.get("decode_tokens_per_s")]
    return {"decode_tokens_per_s": _median(rs, "decode_tokens_per_s"),
            "decode_speedup_vs_plain": statistics.median(decode) if decode else None,
            **expectations(stats, draft_s, verify_s, plain_step, gamma)}


def write(report: dict, out_dir: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = report["config"]
    parts = (c["target"], c["head"] or c["draft"] or "plain", c["dataset"])
    stem = "-".join(Path(str(x)).name for x in parts)
    path = write_text(out / f"{stem}.json", json.dumps(report, indent=1))
    plot(report, path.with_suffix(".png"))
    if "acceptance_per_depth" in report:  # a drafter was given
        plot_acceptance(report, path.with_name(f"{path.stem}-acceptance.png"))
        plot_categories(report, path.with_name(f"{path.stem}-categories.png"))
    return path


def table(report: dict) -> str:
    """The results per temperature and method: measured tokens/s and speedup, the decode phase's speedup beside
    the one the measured acceptance and step costs predict, τ, lossless check; then the memory block."""
    lines = ["| T | method | tokens/s | speedup vs plain | decode phase: speedup, expected | τ | same tokens as plain |",
             "|---|---|---|---|---|---|---|"]
    for temp, res in report["results"].items():
        for name, r in res.items():
            tau = f"{r['tau']:.2f}" if r["tau"] else ""
            tps, speedup = r["tokens_per_s"], r["speedup_vs_plain"]
            lines.append(f"| {temp} | {name} | {tps:.1f} | {speedup:.2f}x | {_expected_cell(r)} | {tau} "
                         f"| {r.get('identical_to_plain') or ''} |")
    return "\n".join(lines + ([""] + memory_lines(report["memory"]) if "memory" in report else []))


def _expected_cell(r: dict) -> str:
    if r.get("expected_speedup") is None:
        return ""  # not our loop (transformers' generate), or no step timed
    measured = r.get("decode_speedup_vs_plain")
    cell = (f"{measured:.2f}x, " if measured is not None else "") + f"{r['expected_speedup']:.2f}x"
    if "expected_speedup_leviathan" in r:
        cell += f" (Leviathan {r['expected_speedup_leviathan']:.2f}x, α {r['alpha']:.2f}, c {r['cost_ratio_c']:.2f})"
    return cell
