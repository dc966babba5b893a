"""``eaglekit bench engine=llama.cpp``: real llama-server processes on the target's GGUF, side by side.

Every configuration is its own llama-server (one slot, ``threads`` threads), all started before the first
request and then asked in turn, prompt by prompt and repeat by repeat (the order rotated), so that machine
drift hits them alike; a configuration with an n-gram type is restarted before each repeat, so that no repeat
drafts from the answers of an earlier one:

- ``plain``: no drafter — the baseline every speedup divides by;
- ``head``: the eaglekit head exported to GGUF at the settings the planner chose (an EAGLE-3 head,
  ``draft-eagle3``); a DSpark, DFlash or DFlash 2 head (``draft-dspark`` / ``draft-dflash``) drafts its block,
  ``block_size - 1`` tokens or ``n_max``, unplanned;
- ``head n=N p=P``: the sweep around it (``sweep_n_max``, ``sweep_p_min``), to show whether the choice is right;
- llama.cpp's n-gram modes (``ngram_types``), a draft model (``draft=``, ``draft-simple``) and the head
  combined with an n-gram mode where llama.cpp takes two types.

Tokens/s is the server's decode phase (``timings.predicted_n / predicted_ms``, the prefill excluded), summed
over the prompts; the report takes the median over repeats and each speedup is the median of the repeats'
paired ratios. Acceptance comes from ``draft_n`` / ``draft_n_accepted``. Every greedy output is compared with
plain llama-server's (llama.cpp's batched kernels can flip a near-tie: the first differing token is kept).

The planner (``plan``) picks ``--spec-draft-n-max`` / ``--spec-draft-p-min`` from measured costs: the plain
step time, the target's forward over n tokens (prompt processing of n new tokens after a cached prefix), the
head's cost per forward (from a probe run) and the head's drafts replayed on calibration prompts (``replay``:
eaglekit's own head on llama-server's own greedy output, its top-10-renormalised probabilities as llama.cpp's
sampler gives them). It never sees the benched prompts.

``replay`` also gives the τ eaglekit's head has on the exact sequences llama-server produced — the like-for-like
τ beside the server's (``decode.generate``'s own τ is reported too: its fp32 target decodes slightly other text).
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eaglekit import assets
from eaglekit.bench.prompts import load_questions
from eaglekit.engines import llama_cpp
from eaglekit.fileio import write_json
from eaglekit.heads.registry import HEADS

PROBE = (3, 0.0)  # the head run that measures its cost per forward
# llama-server's --spec-type for each head kind eaglekit exports to it (llama_cpp.refusal names the rest)
SPEC_TYPES = {kind: cls.llama_cpp_spec_type for kind, cls in HEADS.items() if cls.llama_cpp_spec_type}


# ---- eaglekit's head on llama-server's sequences ------------------------------------------------------
@torch.no_grad()
def head_drafts(target, head, prompt: list[int], tokens: list[int], depth: int):
    """(drafts [S, depth] target ids, top-prob [S, depth]) of chain drafting from every anchor of the sequence
    ``prompt + tokens`` a server drafts from: row t holds what the head drafts when the last known token is at
    t + 1, for t >= len(prompt) - 1 (the rows before, anchors inside the prompt, hold -1 / 0.0; ``replay`` never
    reads them). An EAGLE head: the TTT unroll, which equals sequential drafting; a parallel head — DFlash,
    DSpark — the prompt's context in one call, then one block per output element, fed one element at a time
    (each block reads the whole draft vocabulary's rows: drafting from every prompt anchor too cost a DFlash head
    on SmolLM2 3x the time). Probabilities are softmax over the top 10, llama.cpp's draft sampler."""
    from eaglekit.heads.objectives import ttt_unroll

    seq = torch.tensor([list(prompt) + list(tokens)], device=target.device)
    g = head.fuse(target.forward(seq, layer_ids=head.taps, logits=False).taps)
    S, first = seq.shape[1], max(len(prompt) - 1, 0)
    drafts, probs = torch.full((S, depth), -1), torch.zeros(S, depth)
    if first >= S - 1:  # no output token: nothing is drafted from
        return drafts, probs
    if getattr(head, "parallel", False):
        cache = head.new_cache()
        if first > 0:  # the prompt's context, whose drafts no server uses
            head.draft(cache, seq[:, 1:first + 1], g[:, :first], torch.arange(first)[None])
        blocks = [head.draft(cache, seq[:, t + 1:t + 2], g[:, t:t + 1], torch.tensor([[t]]))[0, :depth]
                  for t in range(first, S - 1)]
        steps = [d[None] for d in torch.stack(blocks + [blocks[-1]]).unbind(1)]  # [1, S - first, Vd] per depth
    else:
        steps = [logits[:, first:] for _, _, logits in ttt_unroll(head, seq, g, depth)]
    for k, logits in enumerate(steps):
        top = logits[0].float().topk(min(10, logits.shape[-1]), dim=-1)
        drafts[first:, k] = (top.indices[:, 0] + head.d2t[top.indices[:, 0]]).cpu()
        probs[first:, k] = top.values.softmax(-1)[:, 0].cpu()
    return drafts, probs


def replay(sequence: list[int], start: int, drafts, probs, n_max: int, p_min: float = 0.0) -> dict:
    """llama.cpp's greedy chain on a known output: ``sequence`` = prompt + output, ``start`` = index of the first
    output token (the prefill's). Each step drafts up to ``n_max`` tokens, stopping at a top probability below
    ``p_min``; the target accepts the matching prefix and adds one token. Returns steps, drafted, accepted, head
    forwards (one per drafted token, plus the one that stopped early) and τ (tokens per step)."""
    n, p = len(sequence), start
    steps = drafted = accepted = forwards = 0
    draft_lengths = []
    while p < n - 1:
        t = p - 1
        d = 0
        while d < n_max and probs[t, d] >= p_min:
            d += 1
        a = 0
        while a < d and p + 1 + a < n and int(drafts[t, a]) == sequence[p + 1 + a]:
            a += 1
        emitted = min(a + 1, n - 1 - p)
        steps, drafted, accepted = steps + 1, drafted + d, accepted + emitted - 1
        forwards += min(d + 1, n_max)
        draft_lengths.append(d)
        p += emitted
    return {"steps": steps, "drafted": drafted, "accepted": accepted, "forwards": forwards,
            "draft_lengths": draft_lengths, "tau": (n - 1 - start) / max(steps, 1)}


# ---- measured costs and the planner -------------------------------------------------------------------
def forward_ms(server, prompt: list[int], sizes, repeats: int = 5) -> dict[int, float]:
    """The target's forward over n new tokens after a cached prefix (prompt processing): the fastest of
    ``repeats`` per n (interference only ever adds time)."""
    out = {}
    for n in sizes:
        times = []
        for r in range(repeats):
            base = list(prompt)
            server.complete(base, 1, cache_prompt=True)  # cache the prefix
            extra = [prompt[(i + r) % len(prompt)] for i in range(n)]
            res = server.complete(base + extra, 1, cache_prompt=True)
            if res.timings.get("prompt_n") == n:
                times.append(float(res.timings["prompt_ms"]))
        out[n] = min(times) if times else float("nan")
    return out


def plan(replays_by_setting: dict, step_ms: float, fwd: dict[int, float], head_ms: float) -> dict:
    """Predicted decode tokens/s of every (n_max, p_min) from its replay on the calibration prompts: per step
    the target's forward over d + 1 tokens (scaled so one token costs the plain step) plus ``head_ms`` per
    head forward. Returns {(n, p): predicted tok/s} and the best setting; (0, 0.0) is plain decoding, chosen
    when no setting is predicted to beat it (a head that does not pay is not used)."""
    one = fwd.get(1) or step_ms
    predicted = {(0, 0.0): 1000.0 / step_ms}
    for (n, p), runs in replays_by_setting.items():
        ms = sum(step_ms * fwd.get(d + 1, fwd[max(fwd)] * (d + 1) / max(fwd)) / one + head_ms * f
                 for r in runs for d, f in zip(r["draft_lengths"], _forwards(r["draft_lengths"], n)))
        tokens = sum(r["steps"] * r["tau"] for r in runs)
        predicted[(n, p)] = 1000.0 * tokens / ms if ms else 0.0
    best = max(predicted, key=predicted.get)
    return {"predicted_tokens_per_s": predicted, "n_max": best[0], "p_min": best[1]}


def _forwards(lengths, n_max):
    return [min(d + 1, n_max) for d in lengths]


# ---- the bench ------------------------------------------------------------------------------------------
def _gguf(name_or_path: str | None) -> Path | None:
    if not name_or_path:
        return None
    p = Path(name_or_path)
    if p.suffix == ".gguf" and p.is_file():
        return p
    if name_or_path in assets.ASSETS:
        return assets.asset_file(name_or_path)
    raise FileNotFoundError(f"{name_or_path}: not a .gguf file nor an embedded model (engine=llama.cpp serves GGUF)")


class TokenizerOnly:
    """A target's chat template without its weights (the bench without a head)."""

    def __init__(self, name: str):
        from transformers import AutoTokenizer

        from eaglekit.target import Target, resolve

        self.tokenizer = AutoTokenizer.from_pretrained(resolve(name)[0])
        self.chat_ids = Target.chat_ids.__get__(self)


def configurations(cfg, head_gguf, draft_gguf, chosen, spec: str = "draft-eagle3") -> dict[str, dict]:
    """name -> llama_cpp.Server keyword arguments (``model`` added by the caller)."""
    out = {"plain": {}}
    if head_gguf is not None:
        eagle = {"draft": head_gguf, "spec_type": spec}
        # the planner's choice; n_max 0 = it predicts no setting beats plain, so the head is not loaded
        out["head"] = {**eagle, "n_max": chosen[0], "p_min": chosen[1]} if chosen[0] else {}
        picked, chosen = chosen[0], (chosen[0] or PROBE[0], chosen[1])  # the sweep still measures the head
        for n in cfg.sweep_n_max:
            if n != picked:
                out[f"head n={n} p={chosen[1]:g}"] = {**eagle, "n_max": n, "p_min": chosen[1]}
        for p in cfg.sweep_p_min:
            if p != chosen[1]:
                out[f"head n={chosen[0]} p={p:g}"] = {**eagle, "n_max": chosen[0], "p_min": p}
        for t in cfg.combine_ngram:
            out[f"head+{t}"] = {**eagle, "spec_type": f"{spec},{t}", "n_max": chosen[0], "p_min": chosen[1]}
    for t in cfg.ngram_types:
        out[t] = {"spec_type": t}
    if draft_gguf is not None:
        out["draft model"] = {"draft": draft_gguf, "spec_type": "draft-simple", "n_max": cfg.gamma}
    return out


def run_engine_bench(cfg) -> dict:
    from eaglekit.export import export_head, load_head
    from eaglekit.target import load_target

    root = llama_cpp.require()
    threads = cfg.threads or None
    model = _gguf(cfg.target_gguf or cfg.target)
    if cfg.head or cfg.head_gguf:  # before any model is loaded or server started
        llama_cpp.check_draft_target(model)
    # the head's replay needs the target; without a head its tokenizer's chat template is enough
    target = load_target(cfg.target) if cfg.head else TokenizerOnly(cfg.target)
    out_dir = Path(cfg.out)
    head = load_head(cfg.head, target) if cfg.head else None
    spec = SPEC_TYPES.get(head.config.kind, "draft-eagle3") if head is not None else "draft-eagle3"
    # the planner (its calibration answers, forward costs and probe) for an EAGLE-3 head only: a block drafter
    # drafts its block in one forward, nothing to plan
    planned = head is not None and spec == "draft-eagle3"
    head_gguf = Path(cfg.head_gguf) if cfg.head_gguf else None
    if head is not None and head_gguf is None:
        head_gguf = export_head(head, out_dir / "head", "llama.cpp", gguf_type=cfg.gguf_type, overwrite=True)
    questions = load_questions(cfg.dataset, cfg.prompts + cfg.calibration_prompts, cfg.prompt_order)
    prompts = [target.chat_ids(text)[0].tolist() for _, text in questions]
    bench, calib = prompts[:cfg.prompts], prompts[cfg.prompts:]
    planner = None
    with llama_cpp.Server(model, root=root, threads=threads) as plain:
        # the top-2 log-probabilities along plain's path: where another configuration's output leaves it,
        # how near a tie the target was there (llama.cpp's multi-token kernels round differently)
        refs = [plain.complete(ids, cfg.max_new_tokens, n_probs=2) for ids in bench]
        calib_refs = [plain.complete(ids, cfg.max_new_tokens) for ids in calib] if planned else []
        fwd = forward_ms(plain, bench[0], range(1, max(cfg.sweep_n_max + [PROBE[0], 8]) + 2)) if planned else {}
    block = head.config.block_size - 1 if head is not None and not planned else PROBE[0]
    chosen = (cfg.n_max or block, cfg.p_min if cfg.p_min >= 0 else 0.0)
    if planned:
        planner = _plan(cfg, root, model, head_gguf, target, head, calib, calib_refs, fwd, threads)
        if not cfg.n_max:
            chosen = (planner["n_max"], chosen[1] if cfg.p_min >= 0 else planner["p_min"])
        elif cfg.p_min < 0:
            chosen = (cfg.n_max, max((p for (n, p) in planner["predicted_tokens_per_s"] if n == cfg.n_max),
                                     key=lambda p: planner["predicted_tokens_per_s"][(cfg.n_max, p)]))
    confs = configurations(cfg, head_gguf, _gguf(cfg.draft), chosen, spec)
    runs = measure(cfg, root, model, confs, bench, refs, threads)
    report = summarise(runs, refs)
    if head is not None:
        report["eaglekit"] = _eaglekit_tau(target, head, bench, refs, chosen)
    if planner is not None:
        report["planner"] = {"chosen": {"n_max": chosen[0], "p_min": chosen[1]},
                             "predicted_tokens_per_s": {f"n={n} p={p:g}": v
                                                        for (n, p), v in planner["predicted_tokens_per_s"].items()},
                             "costs": planner["costs"]}
    return {"config": asdict(cfg), "engine": f"llama.cpp (llama-cpp-python=={llama_cpp.VERSION} vendor)",
            "target_gguf": str(model), "head_gguf": str(head_gguf) if head_gguf else None,
            "head_gguf_mb": head_gguf.stat().st_size / 2**20 if head_gguf else None,
            "target_gguf_mb": model.stat().st_size / 2**20, "threads": threads,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **report}


def _plan(cfg, root, model, head_gguf, target, head, calib, calib_refs, fwd, threads) -> dict:
    """Measure the head's cost per forward (a probe server) and plan (n_max, p_min) on the calibration prompts."""
    depth = max(cfg.sweep_n_max + [PROBE[0], 8])
    drafts = [head_drafts(target, head, ids, r.tokens, depth) for ids, r in zip(calib, calib_refs)]
    replays = {(n, p): [replay(ids + r.tokens, len(ids), d, q, n, p) for ids, r, (d, q) in zip(calib, calib_refs, drafts)]
               for n in range(1, depth + 1) for p in cfg.plan_p_min}
    with llama_cpp.Server(model, draft=head_gguf, spec_type="draft-eagle3", n_max=PROBE[0], p_min=PROBE[1],
                          root=root, threads=threads) as probe:
        outs = [probe.complete(ids, cfg.max_new_tokens) for ids in calib]
    step_ms = sum(float(r.timings["predicted_ms"]) for r in calib_refs) / sum(len(r.tokens) for r in calib_refs)
    probe_ms = sum(float(o.timings["predicted_ms"]) for o in outs)
    probe_steps = sum(o.steps for o in outs)
    rp = replays[PROBE]
    target_ms = sum(step_ms * fwd.get(d + 1, float("nan")) / fwd[1] for r in rp for d in r["draft_lengths"])
    head_ms = max((probe_ms * sum(r["steps"] for r in rp) / max(probe_steps, 1) - target_ms)
                  / max(sum(r["forwards"] for r in rp), 1), 0.0)
    planned = plan(replays, step_ms, fwd, head_ms)
    planned["costs"] = {"plain_step_ms": step_ms, "forward_ms_by_tokens": fwd, "head_ms_per_forward": head_ms,
                        "probe": {"n_max": PROBE[0], "p_min": PROBE[1], "tau_server": server_tau(outs),
                                  "tau_replay": _tau_replay(rp)}}
    return planned


def measure(cfg, root, model, confs: dict, prompts, refs, threads) -> dict:
    """Start every configuration's server, then ask each in turn (rotated per prompt) ``cfg.repeats`` times.
    A configuration with an n-gram type gets a fresh server for every repeat: llama.cpp's n-gram stores
    (ngram-mod's hash, ngram-map's, ngram-cache's) learn from each answer their server gave, so a second repeat
    would draft the benched answers from memory (HumanEval, 12-05: ngram-mod 1.84x in the first repeat, 2.6x in
    the next two)."""
    servers = {}

    def start(name):
        servers[name] = llama_cpp.Server(model, root=root, threads=threads, **confs[name]).__enter__()
        servers[name].complete(prompts[0][:32], 8)  # warm-up: first-request allocations

    runs = {name: [] for name in confs}
    try:
        for name in confs:
            start(name)
        names = list(confs)
        for rep in range(cfg.repeats):
            for name in names if rep else ():
                if "ngram" in (confs[name].get("spec_type") or ""):
                    servers.pop(name).close()
                    start(name)
            outs = {name: [] for name in names}
            for i, ids in enumerate(prompts):
                k = (rep * len(prompts) + i) % len(names)
                for name in names[k:] + names[:k]:
                    outs[name].append(servers[name].complete(ids, cfg.max_new_tokens))
            for name in names:
                runs[name].append(outs[name])
    finally:
        for s in servers.values():
            s.close()
    return runs


def server_tau(outs) -> float:
    """Tokens per step of llama-server completions (the prefill's token excluded), as eaglekit counts τ."""
    return sum(len(o.tokens) - 1 for o in outs) / max(sum(o.steps for o in outs), 1)


def _tau_replay(runs) -> float:
    return sum(r["steps"] * r["tau"] for r in runs) / max(sum(r["steps"] for r in runs), 1)


def first_diff(a: list[int], b: list[int]) -> int | None:
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return j if j is not None else (None if len(a) == len(b) else min(len(a), len(b)))


def summarise(runs: dict, refs) -> dict:
    def tps(outs):
        return sum(int(o.timings["predicted_n"]) for o in outs) / sum(float(o.timings["predicted_ms"]) for o in outs) * 1e3

    plain = [tps(rep) for rep in runs["plain"]]
    results = {}
    for name, reps in runs.items():
        speeds = [tps(rep) for rep in reps]
        diffs = [[first_diff(o.tokens, r.tokens) for o, r in zip(rep, refs)] for rep in reps]
        flat = list(itertools.chain(*reps))
        drafted = sum(o.draft_n for o in flat)
        results[name] = {
            "tokens_per_s": statistics.median(speeds), "repeats_tokens_per_s": speeds,
            "speedup_vs_plain": statistics.median(s / p for s, p in zip(speeds, plain)),
            "tau": server_tau(flat) if drafted else None, "draft_n": drafted,
            "acceptance": sum(o.accepted for o in flat) / drafted if drafted else None,
            "identical_to_plain": f"{sum(d is None for d in diffs[0])}/{len(refs)}",
            "first_differences": [d for d in diffs[0]],
            "divergences": [{"prompt": i, "position": d, "plain_top2_logprob_gap": top2_gap(refs[i], d)}
                            for i, d in enumerate(diffs[0]) if d is not None],
        }
    return {"results": results}


def top2_gap(ref, position: int) -> float | None:
    """The gap between plain's two most likely tokens at ``position`` of its output (log-probabilities, as
    llama-server reports them before sampling); None where it reported none there."""
    if position >= len(ref.top) or len(ref.top[position]) < 2:
        return None
    first, second = sorted(ref.top[position].values(), reverse=True)[:2]
    return first - second


def _eaglekit_tau(target, head, prompts, refs, chosen) -> dict:
    """eaglekit's τ for the head at the same chain: replayed on llama-server's outputs (like for like) and
    decoded by eaglekit's own loop (its fp32 target's text)."""
    from eaglekit import decode
    from eaglekit.decode.drafters import TreeSpec

    n, p = chosen[0] or PROBE[0], chosen[1]  # the planner chose plain: the probe's chain
    runs = []
    for ids, r in zip(prompts, refs):
        d, q = head_drafts(target, head, ids, r.tokens, n)
        runs.append(replay(ids + r.tokens, len(ids), d, q, n, p))
    own = [decode.generate(target, head, torch.tensor([ids]), len(r.tokens), eos_token_id=False,
                           tree=TreeSpec(depth=n, top_k=1, total_tokens=n)).stats for ids, r in zip(prompts, refs)]
    return {"n_max": n, "p_min": p, "tau_replay_on_server_outputs": _tau_replay(runs),
            "tau_decode_generate": sum(sum(s.accept_lengths) for s in own) / max(sum(len(s.accept_lengths) for s in own), 1)}


def table(report: dict) -> str:
    rows = ["| configuration | tok/s | speedup | τ | acceptance | identical |", "|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        tau = f"{r['tau']:.2f}" if r["tau"] else "—"
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "—"
        rows.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}x | {tau} | {acc} | "
                    f"{r['identical_to_plain']} |")
    if "eaglekit" in report:
        e = report["eaglekit"]
        rows.append(f"\neaglekit's τ for the head at n_max={e['n_max']} p_min={e['p_min']:g}: "
                    f"{e['tau_replay_on_server_outputs']:.3f} replayed on llama-server's outputs, "
                    f"{e['tau_decode_generate']:.3f} in decode.generate (its own fp32 text)")
    return "\n".join(rows)


def write(report: dict, out: str) -> Path:
    c = report["config"]
    # the name as given ("qwen2.5-coder-1.5b-instruct" has no suffix to strip), and the GGUF file when it is not
    # the embedded one
    gguf = f"-{Path(c['target_gguf']).stem}" if c.get("target_gguf") else ""
    name = f"llama-cpp-{Path(c['target']).name}{gguf}-{c['dataset']}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = write_json(Path(out) / f"{name}.json", report)
    plot_engine(report, path.with_suffix(".png"))
    return path


def plot_engine(report: dict, path: Path) -> Path | None:
    from eaglekit.bench.plots import _pyplot, _save

    plt = _pyplot()
    if plt is None:
        return None
    names = list(report["results"])
    speed = [report["results"][n]["speedup_vs_plain"] for n in names]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names)), 4))
    ax.bar(range(len(names)), speed, color=["grey" if n == "plain" else "tab:blue" for n in names])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_ylabel("decode tokens/s vs plain llama-server")
    c = report["config"]
    ax.set_title(f"llama.cpp — {Path(c['target']).stem} — {c['dataset']}")
    return _save(plt, fig, path)
