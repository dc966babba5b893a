"""The bench's report: summaries over repeats, speedup per prompt category, acceptance per depth, the
JSON file (with its PNGs) and a markdown table."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from eaglekit.bench.plots import plot, plot_acceptance, plot_categories
from eaglekit.fileio import write_text


def rates(stats) -> list[float | None]:
    """DecodeStats.acceptance_per_depth, the one definition: the rate at depth d is
    P(the depth-d draft token is accepted | depths 1..d-1 were accepted and the tree reached depth d),
    i.e. #steps accepting >= d drafted tokens / #steps accepting >= d-1 whose tree reached depth d.
    A conditional rate, so not monotone in d. None where no step qualified (NaN is not JSON)."""
    return [None if math.isnan(r) else r for r in stats.acceptance_per_depth]


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


def summarise(runs: dict) -> dict:
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    out = {}
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        same = [r["identical_to_plain"] for r in rs if r.get("identical_to_plain")]
        out[name] = {"tokens_per_s": tps, "speedup_vs_plain": tps / plain,
                         "tau": statistics.median(taus) if taus else None,
                         "identical_to_plain": ", ".join(same) if same else None, "repeats": rs}
    assisted = [n for n in out if n.startswith("hf_assisted_")]
    if assisted:
        best = max(assisted, key=lambda n: out[n]["tokens_per_s"])
        out[best]["best_of_assisted"] = True
    return out


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
    lines = ["| T | method | tokens/s | speedup vs plain | τ | same tokens as plain |", "|---|---|---|---|---|---|"]
    for temp, res in report["results"].items():
        for name, r in res.items():
            tau = f"{r['tau']:.2f}" if r["tau"] else ""
            tps, speedup = r["tokens_per_s"], r["speedup_vs_plain"]
            lines.append(f"| {temp} | {name} | {tps:.1f} | {speedup:.2f}x | {tau} | {r.get('identical_to_plain') or ''} |")
    return "\n".join(lines)
