"""What the GPU recipe (``h200_run.py``) moves on and off a lent machine, and the record it keeps.

The device tool carries at most 64 MiB each way and brings back at most 8 files of 16 MiB, so a big file
travels as ``name.part0``, ``name.part1``, ... (``write_parts`` / ``join_parts``); the regenerated JSONL
goes back gzipped and cut to whole lines that fit a size cap (``gzip_prefix``), and the training log
becomes the data-scaling record: held-out τ_sim against the tokens trained on (``scaling_record``).
"""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import tarfile
import time
from pathlib import Path

from eaglekit.fileio import atomic_write, write_bytes, write_json

ROOT = Path(__file__).resolve().parents[2]
PART_BYTES = 15 << 20  # under the 16 MiB a file may have on its way back


def sh(cmd: list[str], timeout: float, env: dict | None = None) -> float:
    """Run a command from the repository root (its output to ours), raise on failure or when it runs
    past ``timeout`` seconds (it is killed then); return its wall time."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=max(timeout, 1), env=env)
    return time.perf_counter() - t


def whole_lines(path: Path) -> list[bytes]:
    """The complete lines of a JSONL file (a line torn by a kill, without its newline, is left out)."""
    return path.read_bytes().split(b"\n")[:-1] if path.exists() else []


def gzip_prefix(lines: list[bytes], max_bytes: int) -> tuple[bytes, int]:
    """Gzip the longest prefix of ``lines`` (found by shrinking in proportion) whose gzip fits
    ``max_bytes``; return (gzip bytes, lines kept)."""
    keep = len(lines)
    while True:
        blob = gzip.compress(b"".join(line + b"\n" for line in lines[:keep]), 6)
        if len(blob) <= max_bytes or keep == 0:
            return blob, keep
        keep = min(keep - 1, int(keep * max_bytes / len(blob) * 0.98))


def write_parts(data: bytes, out: Path, name: str, part_bytes: int = PART_BYTES) -> list[str]:
    """``out/name`` if ``data`` fits one part, else ``out/name.part0``, ``.part1``, ...; return the names."""
    if len(data) <= part_bytes:
        write_bytes(out / name, data)
        return [name]
    names = []
    for k, i in enumerate(range(0, len(data), part_bytes)):
        names.append(f"{name}.part{k}")
        write_bytes(out / names[-1], data[i : i + part_bytes])
    return names


def join_parts(folder: Path, name: str) -> bytes:
    """``folder/name``, or its parts ``name.part0..N`` joined in order; one clear error if neither is
    there or a part is missing."""
    if (folder / name).is_file():
        return (folder / name).read_bytes()
    found = {int(m.group(1)): p for p in folder.glob(f"{name}.part*")
             if (m := re.fullmatch(re.escape(name) + r"\.part(\d+)", p.name))}
    if not found:
        raise FileNotFoundError(f"{folder}: neither {name} nor {name}.part0, .part1, ... is there")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise FileNotFoundError(f"{folder}: {name}.part{missing[0]} is missing (have parts {sorted(found)})")
    return b"".join(found[k].read_bytes() for k in sorted(found))


def regen_counts(lines: list[bytes]) -> dict:
    """Conversations in a regenerated JSONL, how many got an answer, and the assistant turns written."""
    items = [json.loads(line) for line in lines]
    answered = [it for it in items if it.get("messages")]
    turns = sum(m.get("role") == "assistant" for it in answered for m in it["messages"])
    return {"conversations": len(items), "answered": len(answered), "unanswered": len(items) - len(answered),
            "assistant_turns": turns}


def scaling_record(log_path: Path) -> dict:
    """Held-out τ_sim (and accuracy per TTT step) against the training tokens seen, from a run's
    ``log.jsonl``: one point per evaluation record, the final evaluation last. Tokens are summed over
    the logged steps, so they are exact with ``log_interval=1`` (``logged_steps`` == the last step)."""
    points, seen, logged, per_epoch, epoch = [], 0, 0, {}, 0
    for raw in log_path.read_text().splitlines():
        rec = json.loads(raw)
        if not rec.get("final") and "tokens" in rec:
            epoch = rec.get("epoch", epoch)
            seen, logged = seen + int(rec["tokens"]), logged + 1
            per_epoch[epoch] = per_epoch.get(epoch, 0) + int(rec["tokens"])
        if "eval_tau_sim" in rec:
            acc = [rec[f"eval_acc_{k}"] for k in range(64) if f"eval_acc_{k}" in rec]
            points.append({"step": rec.get("step"), "epoch": epoch, "tokens_seen": seen,
                           "eval_tau_sim": rec["eval_tau_sim"], "eval_acc": acc, "final": bool(rec.get("final"))})
    full = [n for e, n in per_epoch.items() if e + 1 in per_epoch]  # epochs the run went past
    return {"points": points, "logged_steps": logged, "tokens_per_epoch": full[0] if full else None,
            "source": log_path.name}


def bench_summary(report: dict) -> dict:
    """An ``eaglekit bench`` report cut to what the summary compares, per temperature (and batch size, for
    a batch bench) and method: τ, tokens/s, speedup vs plain (and vs HF prompt lookup where it ran),
    tokens identical to plain, and the drafter's ms per step drafting and verifying (our loop only)."""
    out = {"tree": report.get("tree"), "load_average": report.get("load_average"), "date": report.get("date")}
    for temp, res in (report.get("results") or {}).items():
        if report.get("mode") == "batch":
            out[temp] = {size: _method_rows(per_size) for size, per_size in res.items()}
        else:
            out[temp] = _method_rows(res)
    return out


def _method_rows(res: dict) -> dict:
    tps = {m: r["tokens_per_s"] for m, r in res.items() if isinstance(r, dict) and "tokens_per_s" in r}
    rows = {}
    for m, r in res.items():
        if m not in tps:
            continue
        row = {"tokens_per_s": tps[m], "tau": r.get("tau"), "identical_to_plain": r.get("identical_to_plain")}
        if tps.get("plain"):
            row["vs_plain"] = tps[m] / tps["plain"]
        if tps.get("hf_lookup"):
            row["vs_hf_lookup"] = tps[m] / tps["hf_lookup"]
        for key in ("draft_s_per_forward", "verify_s_per_forward"):
            if r.get(key) is not None:
                row[key.replace("_s_", "_ms_")] = 1000 * r[key]
        rows[m] = row
    return rows


def write_scaling(record: dict, path: Path) -> None:
    """``path`` (JSON) and, where matplotlib is installed, a PNG beside it."""
    write_json(path, record)
    pts = record["points"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([p["tokens_seen"] / 1e6 for p in pts], [p["eval_tau_sim"] for p in pts], "o-")
    ax.set_xlabel("training tokens seen (M)")
    ax.set_ylabel("held-out τ_sim")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path.with_suffix(".png"), lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)


def tar_files(dest: Path, root: Path, paths: list[Path], mode: str = "w:gz") -> None:
    """The files of ``paths`` that exist, named relative to ``root``, in one tarball (few files travel back)."""
    def write(tmp: str) -> None:
        with tarfile.open(tmp, mode) as tar:
            for p in paths:
                if p.is_file():
                    tar.add(p, arcname=str(p.relative_to(root)))
    atomic_write(dest, write)


def sharegpt_subset(n: int, max_turns: int) -> list[dict]:
    """The first ``n`` valid conversations of the embedded ShareGPT as ``{"id", "messages"}``, each cut to
    its first ``max_turns`` user turns (0: all): what regeneration on the device reads."""
    from eaglekit.data_prep.conversations import load_sharegpt
    from eaglekit.data_prep.prepare import first_turns

    return [{"id": c["id"], "messages": first_turns(c["messages"], max_turns)} for c in load_sharegpt(limit=n)]


if __name__ == "__main__":  # pack.sh: python benchmarks/gpu/gpu_io.py sharegpt-subset --n N --max-turns T --out F
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["sharegpt-subset"])
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    items = sharegpt_subset(a.n, a.max_turns)
    write_bytes(Path(a.out), gzip.compress(json.dumps(items, ensure_ascii=False).encode(), 9))
    print(f"{len(items):,} conversations (first {a.max_turns or 'all'} user turns) → {a.out}")
