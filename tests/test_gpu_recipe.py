"""The GPU recipe (benchmarks/gpu/): its two steps run end to end on the CPU with tiny sizes (regenerate →
carry the JSONL → train EAGLE-3 and DFlash heads (``--kinds``), score, bench each, bring a head back), and the
pieces that move files on and off a lent machine (parts under 16 MiB, a gzip cap on whole lines, the
data-scaling record, the bench runs, the per-kind budget and bench summary)."""
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import gpu_io
import h200_run

from eaglekit.bench.cli import BenchConfig
from eaglekit.config import load_config


def test_parts_round_trip_and_a_missing_part_is_named(tmp_path):
    data = os.urandom(2500)
    names = gpu_io.write_parts(data, tmp_path, "x.gz", part_bytes=1000)
    assert names == ["x.gz.part0", "x.gz.part1", "x.gz.part2"]
    assert all((tmp_path / n).stat().st_size <= 1000 for n in names)
    assert gpu_io.join_parts(tmp_path, "x.gz") == data
    (tmp_path / "x.gz.part1").unlink()
    with pytest.raises(FileNotFoundError, match=r"x\.gz\.part1 is missing"):
        gpu_io.join_parts(tmp_path, "x.gz")
    assert gpu_io.write_parts(b"small", tmp_path, "y", part_bytes=1000) == ["y"]
    assert gpu_io.join_parts(tmp_path, "y") == b"small"


def test_gzip_prefix_keeps_whole_lines_under_the_cap():
    lines = [json.dumps({"id": str(i), "text": os.urandom(200).hex()}).encode() for i in range(200)]
    blob, keep = gpu_io.gzip_prefix(lines, 20_000)
    assert len(blob) <= 20_000 and 0 < keep < len(lines)
    assert gzip.decompress(blob) == b"".join(x + b"\n" for x in lines[:keep])
    whole, everything = gpu_io.gzip_prefix(lines, 10**9)
    assert everything == len(lines) and gzip.decompress(whole).count(b"\n") == len(lines)


def test_scaling_record_sums_tokens_up_to_each_evaluation(tmp_path):
    recs = [{"step": s, "epoch": (s - 1) // 3, "loss": 1.0, "tokens": 100 * s} for s in range(1, 7)]
    recs[1].update(eval_tau_sim=1.2, eval_acc_0=0.1, eval_acc_1=0.05)  # step 2: 100 + 200 tokens seen
    recs[3].update(eval_tau_sim=1.4, eval_acc_0=0.3, eval_acc_1=0.1)  # step 4: 1,000
    recs.append({"eval_tau_sim": 1.5, "eval_acc_0": 0.35, "eval_acc_1": 0.15, "step": 6, "final": True})
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rec = gpu_io.scaling_record(tmp_path / "log.jsonl")
    assert [(p["step"], p["tokens_seen"], p["eval_tau_sim"]) for p in rec["points"]] == [
        (2, 300, 1.2), (4, 1000, 1.4), (6, 2100, 1.5)]
    assert rec["points"][1]["eval_acc"] == [0.3, 0.1] and rec["points"][-1]["final"]
    assert [p["epoch"] for p in rec["points"]] == [0, 1, 1]  # the final record takes the last epoch
    assert rec["logged_steps"] == 6 and rec["tokens_per_epoch"] == 600  # epoch 0 = steps 1..3


def test_bench_runs_are_valid_bench_configs_with_the_batch_sizes_split():
    a = h200_run.parse(["--out", "x"])
    runs = h200_run.bench_runs(a)
    assert list(runs) == ["main", "compiled", "batch", "batch-large", "t1"]
    cfgs = {name: load_config(BenchConfig, None, extra) for name, extra in runs.items()}
    assert cfgs["main"].tree == "auto" and cfgs["main"].hf_baselines and cfgs["main"].temperatures == [0.0]
    assert cfgs["batch"].batch_sizes == [1, 2, 4, 8] and cfgs["batch-large"].batch_sizes == [16, 32, 64]
    assert cfgs["batch-large"].prompts == 64 and cfgs["t1"].temperatures == [1.0]
    assert cfgs["compiled"].compile and not cfgs["main"].compile and not cfgs["compiled"].hf_baselines
    small = h200_run.bench_runs(h200_run.parse(["--out", "x", "--batch-sizes", "1,2", "--benches", "batch,bf16"]))
    assert list(small) == ["batch", "bf16"]
    base = ["dtype=float32"]  # what bench() puts first: a run's own keys come after and win
    assert load_config(BenchConfig, None, base + small["bf16"]).dtype == "bfloat16"
    assert load_config(BenchConfig, None, base + small["batch"]).batch_sizes == [1, 2]


def test_kinds_share_the_budget_evenly_and_a_wrong_kind_is_named():
    a = h200_run.parse(["--out", "x", "--budget-s", "1000", "--bench-reserve-s", "50", "--min-train-minutes", "0.5"])
    assert h200_run.kinds_of(a) == ["eagle3", "peagle", "dflash"]
    h200_run.start_clock()
    minutes = h200_run.train_minutes(a, 3)  # (1000 - 3 * (50 + 45)) / 3 s each, less the few ms since the clock
    assert 3.97 < minutes <= (1000 - 3 * 95) / 180
    assert h200_run.train_minutes(h200_run.parse(["--out", "x", "--budget-s", "100"]), 3) == 1.0  # the floor
    with pytest.raises(SystemExit, match="--kinds: eagel3; choose from eagle3, peagle, dflash"):
        h200_run.kinds_of(h200_run.parse(["--out", "x", "--kinds", "eagle3,eagel3"]))
    for kind, keys in h200_run.KIND_SET.items():  # each arm is a valid training config of its kind
        from eaglekit.train.config import load_train_config

        cfg = load_train_config(ROOT / a.train_config, ["data.conversations=x.jsonl", *keys])
        assert cfg.head.kind == kind


def test_bench_summary_keeps_tau_speed_and_step_costs():
    report = {"tree": "TreeSpec(depth=5, top_k=4, total_tokens=10)", "load_average": [1.0], "date": "d",
              "results": {"0.0": {
                  "plain": {"tokens_per_s": 40.0, "tau": 1.0, "verify_s_per_forward": 0.025, "draft_s_per_forward": 0.0},
                  "ours": {"tokens_per_s": 60.0, "tau": 2.5, "identical_to_plain": "8/8",
                           "draft_s_per_forward": 0.004, "verify_s_per_forward": 0.03},
                  "hf_lookup": {"tokens_per_s": 50.0}, "note": "not a method"}}}
    got = gpu_io.bench_summary(report)
    ours = got["0.0"]["ours"]
    assert (ours["vs_plain"], ours["vs_hf_lookup"], ours["tau"], ours["identical_to_plain"]) == (1.5, 1.2, 2.5, "8/8")
    assert ours["draft_ms_per_forward"] == pytest.approx(4.0) and ours["verify_ms_per_forward"] == pytest.approx(30.0)
    assert set(got["0.0"]) == {"plain", "ours", "hf_lookup"} and got["tree"] == report["tree"]
    batch = gpu_io.bench_summary({"mode": "batch", "results": {"0.0": {"4": report["results"]["0.0"]}}})
    assert batch["0.0"]["4"]["ours"]["vs_plain"] == 1.5


def test_regen_killed_at_the_deadline_keeps_its_whole_lines(tmp_path, monkeypatch):
    """The main regeneration run is killed at the deadline mid-line: the step goes on, the torn line is
    dropped, the lines over the gzip cap too, and prepare (stubbed here) is run on exactly what is kept."""
    from eaglekit.data_prep import prepare

    lines = [json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}, {
        "role": "assistant", "content": hashlib.sha512(str(i).encode()).hexdigest()}]}) for i in range(5)]
    cap = len(gzip.compress("".join(x + "\n" for x in lines[:2]).encode(), 6)) + 8  # 2 lines fit, not 3
    a = h200_run.parse(["--out", str(tmp_path / "out"), "--device", "cpu", "--batch", "2", "--max-gz-mib",
                        str(cap / 2**20), "--sharegpt", str(tmp_path / "src.json"), "--finish-reserve-s", "0"])
    (tmp_path / "src.json").write_text("[]")
    data = tmp_path / "work" / "data"
    calls = []

    def fake_sh(cmd, timeout, env=None):
        calls.append(cmd[-1])
        data.mkdir(parents=True, exist_ok=True)
        with open(data / "regenerated.jsonl", "a") as fh:
            fh.write("".join(x + "\n" for x in lines[len(calls) * 2 - 2 : len(calls) * 2]))
            if len(calls) == 2:
                fh.write(lines[4][:30])  # torn by the kill
                raise subprocess.TimeoutExpired(cmd, timeout)
        return 1.0

    monkeypatch.setattr(h200_run, "sh", fake_sh)
    summary = {}
    h200_run.start_clock()  # the budget is the test's own, whatever ran before it in this process
    assert h200_run.regenerate(a, tmp_path / "work", 100.0, summary) == data
    assert calls == ["num_conversations=2", "num_conversations=0"] and summary["regen_cut_at_deadline"]
    seen = []

    def fake_prepare(cfg):  # what prepare reads: the regenerated file itself, as finish_regen left it
        seen.append(Path(cfg.data).read_text().count("\n"))
        (data / "draft_vocab.safetensors").write_bytes(b"vocab")
        return {"samples": seen[-1], "tokens": 7}

    monkeypatch.setattr(prepare, "run_prepare", fake_prepare)
    record = h200_run.finish_regen(a, data, tmp_path / "out", summary)
    kept = (data / "regenerated.jsonl").read_text().splitlines()
    assert kept == lines[:2] and seen == [2]  # the cap keeps 2 of the 4 whole lines; the torn one is gone
    assert gzip.decompress((tmp_path / "out" / "regenerated.jsonl.gz").read_bytes()).decode().splitlines() == kept
    assert record["conversations"] == 2 and record["lines_dropped_for_size"] == 2
    assert record["cut_at_deadline"] and json.loads((tmp_path / "out" / "prepare.json").read_text()) == record


CONVERSATIONS = [  # one 2-turn conversation: max_turns=2 regenerates both answers
    {"id": "a", "messages": [{"role": "user", "content": "Name three colours."},
                             {"role": "assistant", "content": "Red, green, blue."},
                             {"role": "user", "content": "And two fruits?"},
                             {"role": "assistant", "content": "Apple and pear."}]},
    {"id": "b", "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
    {"id": "c", "messages": [{"role": "user", "content": "Say hello in French."},
                             {"role": "assistant", "content": "Bonjour."}]},
]


def _run_step(step: str, dev: Path, out: Path, extra: str) -> None:
    from eaglekit import assets

    assets.model_dir("smollm2-135m-instruct"), assets.asset_file("mt-bench")  # fetched and converted once
    env = {**os.environ, "STEP": step, "DEV": str(dev), "OUT": str(out), "PY": sys.executable, "BUDGET_S": "900",
           "EAGLEKIT_CACHE": str(assets.cache_dir()),  # the model is converted there: no GGUF join
           "OMP_NUM_THREADS": "1",  # one thread per process: 2 OpenMP threads spin-wait on a busy 2-core box
           "EXTRA_ARGS": f"--device cpu --work {dev.parent / ('work-' + step)} {extra}"}
    res = subprocess.run(["bash", "benchmarks/gpu/run.sh"], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.real
@pytest.mark.slow
def test_gpu_recipe_two_steps_on_cpu(tmp_path):
    dev = tmp_path / "dev"
    (dev / "sharegpt").mkdir(parents=True)
    (dev / "sharegpt" / "sharegpt.json.gz").write_bytes(gzip.compress(json.dumps(CONVERSATIONS).encode()))
    # step 1: answers of 4 tokens; the one-batch probe holds all 3 conversations, so no second run (the
    # probe → run → deadline logic: test_regen_killed_at_the_deadline_keeps_its_whole_lines)
    _run_step("regen", dev, tmp_path / "out1", "--batch 4 --new-tokens 4 --max-turns 2 --finish-reserve-s 0")
    out1 = tmp_path / "out1"
    assert (out1 / "log.txt").read_text().count("eaglekit.cli prepare") == 1
    prep = json.loads((out1 / "prepare.json").read_text())
    assert (prep["conversations"], prep["answered"], prep["assistant_turns"], prep["samples"]) == (3, 3, 4, 3)
    lines = gzip.decompress((out1 / "regenerated.jsonl.gz").read_bytes()).decode().splitlines()
    items = [json.loads(x) for x in lines]
    assert [it["id"] for it in items] == ["a", "b", "c"]
    assert items[0]["messages"][1]["content"] != "Red, green, blue."  # the target's own answer
    assert sorted(p.name for p in out1.iterdir()) == [
        "draft_vocab.safetensors", "log.txt", "prepare.json", "regenerated.jsonl.gz", "summary.json"]

    # the carry: step 1's files into .dev/regen; step 2 trains each kind 4 steps (evaluating every 2) and
    # benches each head on one prompt with a fixed tree (tree=auto's cost probes and the HF baselines are
    # the decode tests' business; here they would only add time)
    shutil.copytree(out1, dev / "regen")
    _run_step("train", dev, tmp_path / "out2",
              "--kinds eagle3,dflash --eval-interval 2 --benches main --bench-prompts 1 --bench-tokens 4 --bench-min-s 0 "
              "--bench-set threads=1 lookup_tokens=0 tree=2,2,3 hf_baselines=false --train-set optim.max_steps=4 data.eval_samples=1 data.batch_size=1 "
              "data.max_length=64 loss.ttt_steps=2")
    out2 = tmp_path / "out2"
    summary = json.loads((out2 / "summary.json").read_text())
    assert list(summary["kinds"]) == ["eagle3", "dflash"]  # an autoregressive kind and a parallel one
    for kind, record in summary["kinds"].items():  # every arm trained, was scored and decoded losslessly
        held = record["held_out"]
        assert held["step"] == 4 and held["eval_tau_sim"] >= 1.0 and held["tau_sim_first_4"] >= 1.0, kind
        assert record["train_budget_min"] == summary["train_budget_min_per_kind"], kind
        main = record["bench"]["main"]["0.0"]
        assert record["bench"]["main"]["tree"] == "TreeSpec(depth=2, top_k=2, total_tokens=3)", kind
        assert main["ours"]["identical_to_plain"] == "1/1" and main["ours"]["tau"] >= 1.0, kind
        assert main["ours"]["verify_ms_per_forward"] > 0 and "vs_plain" in main["ours"], kind
        assert not record.get("benches_failed") and not record.get("benches_skipped"), kind
    # the depths each kind scores: EAGLE-3 the 2 asked, DFlash its whole block of 8 (7 depths)
    assert [sum(k.startswith("eval_acc_") for k in summary["kinds"][kind]["held_out"])
            for kind in ("eagle3", "dflash")] == [2, 7]
    assert all((out2 / n).stat().st_size <= 16 << 20 for n in summary["kinds"]["eagle3"]["head_files"])
    assert "head_files" not in summary["kinds"]["dflash"]  # --bring-heads: eagle3 only (8 files come back)
    (tmp_path / "head.tar").write_bytes(gpu_io.join_parts(out2, "head-eagle3.tar"))
    with tarfile.open(tmp_path / "head.tar") as tar:
        tar.extractall(tmp_path / "head", filter="data")
    from safetensors import safe_open

    config = json.loads((tmp_path / "head" / "final" / "config.json").read_text())
    assert (config["kind"], config["draft_vocab_size"]) == ("eagle3", 8192)  # the draft vocab step 1 built
    with safe_open(tmp_path / "head" / "final" / "model.safetensors", "pt") as f:
        assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(f.keys())
    scaling = json.loads((out2 / "data_scaling.json").read_text())
    pts = scaling["points"]
    assert [p["step"] for p in pts] == [2, 4] and pts[0]["tokens_seen"] < pts[1]["tokens_seen"]
    assert scaling["logged_steps"] == 4 and scaling["data"]["conversations"] == 3
    with tarfile.open(out2 / "results.tar.gz") as tar:
        names = tar.getnames()
        configs = {k: json.load(tar.extractfile(f"heads/{k}/final/config.json")) for k in summary["kinds"]}
        report = json.load(tar.extractfile(next(n for n in names if n.startswith("bench/eagle3/main/")
                                                and n.endswith(".json"))))
    assert {k: (c["kind"], c.get("block_size", 1)) for k, c in configs.items()} == {
        "eagle3": ("eagle3", 1), "dflash": ("dflash", 8)}
    assert {f"heads/{k}/log.jsonl" for k in configs} | {"data/prepare.json", "scaling/dflash.json"} <= set(names)
    assert {"plain", "ours"} <= set(report["results"]["0.0"]) and "hf" not in report["results"]["0.0"]
