"""Capture through a serving engine (eaglekit.data_prep.engine), without vLLM: an engine stand-in that gives
what vLLM's extract_hidden_states files hold (the residual stream entering each asked layer, the last one
before the final norm) makes `eaglekit prepare capture_engine=vllm` write the hook capture's shards; the HTTP
client against a stand-in server (the file and its lock, then both removed); refusals of a target or taps
the engine cannot serve and of files for other tokens or layers; resume after an interrupted capture.

The real engine (`vllm serve` on SmolLM2, features equal to the hook capture within bf16 rounding) is the
slow test at the end."""
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import save_tiny, tiny_target
from safetensors.torch import load_file, save_file

from eaglekit.data_prep import engine as engine_mod
from eaglekit.data_prep.capture import capture_features
from eaglekit.data_prep.engine import (
    EngineError,
    VllmEngine,
    check_engine_target,
    engine_features,
    engine_layer_ids,
    read_states,
    server_args,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def engine_states(target, ids, layer_ids) -> dict[str, torch.Tensor]:
    """What vLLM writes for one prompt: rows for ``layer_ids``, id num_layers the final norm's input."""
    seen = {}
    hook = target.norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("pre", args[0]))
    try:
        taps = [k for k in layer_ids if k < target.num_layers]
        out = target.features(torch.as_tensor([ids]), layer_ids=taps)
    finally:
        hook.remove()
    rows = list(out.taps[0].view(len(ids), len(taps), -1).unbind(1)) if taps else []
    rows += [seen["pre"][0]] * (target.num_layers in layer_ids)
    return {"hidden_states": torch.stack(rows, 1).contiguous(), "token_ids": torch.as_tensor(ids).long()}


class FakeEngine:
    """VllmEngine's interface over a transformers target, one prompt at a time as a server takes them."""

    def __init__(self, model_dir, layer_ids, storage, **_kw):
        from eaglekit.target import load_target

        self.target, self.layer_ids, self.sent = load_target(str(model_dir)), list(layer_ids), 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def many(self, prompts):
        self.sent += len(prompts)
        return [engine_states(self.target, [int(i) for i in p], self.layer_ids) for p in prompts]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


def _prepare(tiny_dir, out, data, *extra):
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare

    common = [f"target={tiny_dir}", f"data={data}", f"output_dir={out}", "max_length=64", "shard_mb=0.001",
              "progress=false", "draft_vocab_size=20"]
    return run_prepare(load_config(PrepareConfig, None, common + list(extra)))


def _convs(path: Path, n: int = 10) -> Path:
    lines = [json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "hi " * (i % 3 + 1)},
                                                     {"role": "assistant", "content": "ok " * (i % 4 + 1)}]})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _shards(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(p) for p in sorted(out.glob("shard-*.safetensors"))}


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_prepare_with_an_engine_writes_the_hook_captures_shards(tmp_path, tiny_dir, monkeypatch, kind):
    monkeypatch.setattr("eaglekit.data_prep.prepare.VllmEngine", FakeEngine)
    data = _convs(tmp_path / "c.jsonl")
    _prepare(tiny_dir, tmp_path / "hooks", data, f"kind={kind}")
    res = _prepare(tiny_dir, tmp_path / "engine", data, f"kind={kind}", "capture_engine=vllm")
    assert res["complete"] and res["shards"] > 1
    hooks, engine = _shards(tmp_path / "hooks"), _shards(tmp_path / "engine")
    assert hooks.keys() == engine.keys()
    for name in hooks:
        assert hooks[name].keys() == engine[name].keys()
        assert ("taps" in engine[name]) == (kind == "eagle3")
        for key, t in hooks[name].items():
            # the same fp32 arithmetic, only unpadded and one sample at a time: equal, or one bf16 step apart
            torch.testing.assert_close(engine[name][key], t, rtol=2**-7, atol=1e-6, msg=f"{name} {key}")
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["extra"]["capture_engine"] == "vllm" and manifest["complete"]
    monkeypatch.setattr("eaglekit.data_prep.prepare.VllmEngine", None)  # a finished capture starts no server
    assert _prepare(tiny_dir, tmp_path / "engine", data, f"kind={kind}", "capture_engine=vllm")["complete"]


def test_an_interrupted_engine_capture_resumes_to_the_same_shards(tmp_path, tiny_dir):
    target = tiny_target()
    samples = [{"input_ids": list(range(1, 6 + i % 5)), "loss_mask": [0, 1] * 3 + [1] * (i % 5)} for i in range(9)]
    taps = target.default_taps
    engine = FakeEngine(tiny_dir, engine_layer_ids(taps, target.num_layers), None)
    engine.target = target
    whole = capture_features(target, samples, tmp_path / "whole", layer_ids=taps, shard_tokens=12, progress=False,
                             features=engine_features(engine, target, taps))

    def killed(j):
        if j == 1:
            raise KeyboardInterrupt  # stands for kill -9 after the second shard's rename

    with pytest.raises(KeyboardInterrupt):
        capture_features(target, samples, tmp_path / "cut", layer_ids=taps, shard_tokens=12, progress=False,
                         features=engine_features(engine, target, taps), on_shard=killed)
    engine.sent = 0
    resumed = capture_features(target, samples, tmp_path / "cut", layer_ids=taps, shard_tokens=12, progress=False,
                               features=engine_features(engine, target, taps))
    assert resumed == whole and whole["complete"]
    first_two = sum(s["num_samples"] for s in whole["shards"][:2])
    assert engine.sent == len(samples) - first_two  # nothing asked twice after the resume
    for f in [s["file"] for s in whole["shards"]] + ["manifest.json"]:
        assert (tmp_path / "cut" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


def test_targets_and_taps_the_engine_cannot_serve_are_refused(tmp_path, tiny_dir, monkeypatch):
    check_engine_target(SimpleNamespace(architectures=["LlamaForCausalLM"]), (0, 2, 3), 4)
    with pytest.raises(ValueError, match="cannot serve.*GPT2LMHeadModel.*capture_engine=hooks"):
        check_engine_target(SimpleNamespace(architectures=["GPT2LMHeadModel"]), (1,), 4)
    with pytest.raises(ValueError, match=r"taps \[4\] are outside"):
        check_engine_target(SimpleNamespace(architectures=["Qwen2ForCausalLM"]), (1, 4), 4)
    # through prepare: refused before anything is written or any server starts
    monkeypatch.setattr(engine_mod, "ENGINE_ARCHITECTURES", frozenset())
    monkeypatch.setattr("eaglekit.data_prep.prepare.VllmEngine", None)
    with pytest.raises(ValueError, match="cannot serve"):
        _prepare(tiny_dir, tmp_path / "out", _convs(tmp_path / "c.jsonl"), "capture_engine=vllm")
    assert not (tmp_path / "out").exists()


def test_files_for_other_tokens_or_layers_are_refused():
    target = tiny_target()
    taps = target.default_taps
    ids = engine_layer_ids(taps, target.num_layers)
    sample = {"input_ids": [3, 4, 5, 6], "loss_mask": [0, 1, 1, 1]}
    good = engine_states(target, sample["input_ids"], ids)
    for bad, why in [({**good, "token_ids": good["token_ids"][1:]}, "other tokens"),
                     ({**good, "hidden_states": good["hidden_states"][:, 1:]}, "other layer ids")]:
        engine = SimpleNamespace(many=lambda prompts, bad=bad: [bad])
        with pytest.raises(EngineError, match=why):
            engine_features(engine, target, taps)([sample])


class _Server(BaseHTTPRequestHandler):
    """vLLM's side of the exchange: writes the request's file (and its lock) and names it in the response."""

    storage: Path
    states: dict

    def log_message(self, *args):
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({"data": [{"id": "served/model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["max_tokens"] == 1 and body["model"] == "served/model"
        path = self.storage / f"{uuid.uuid4().hex}.safetensors"  # vLLM names it by request id
        path.with_name(path.name + ".lock").touch()
        save_file({**self.states, "token_ids": torch.as_tensor(body["prompt"])}, str(path))
        self._reply({"kv_transfer_params": {"hidden_states_path": str(path)} if body["prompt"][0] else None})


def test_the_client_reads_each_requests_file_then_removes_it(tmp_path):
    states = {"hidden_states": torch.randn(3, 2, 8)}
    handler = type("Handler", (_Server,), {"storage": tmp_path, "states": states})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with VllmEngine("unused", [0, 4], tmp_path, endpoint=f"http://127.0.0.1:{server.server_port}/v1",
                        concurrency=2) as engine:
            got = engine.many([[5, 6, 7], [8, 9, 1]])
            assert [g["token_ids"].tolist() for g in got] == [[5, 6, 7], [8, 9, 1]]
            assert all(torch.equal(g["hidden_states"], states["hidden_states"]) for g in got)
            assert list(tmp_path.iterdir()) == []  # files and locks removed once read
            with pytest.raises(EngineError, match="no hidden_states_path"):
                engine.states([0, 1, 2])
    finally:
        server.shutdown()


def test_server_args_and_a_lockless_file(tmp_path):
    args = server_args([2, 0, 2][1:], tmp_path)
    spec, kv = json.loads(args[1]), json.loads(args[3])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2]
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert "--no-enable-prefix-caching" in args and engine_layer_ids((5, 1, 5), 8) == [1, 5, 8]
    save_file({"hidden_states": torch.ones(2, 1, 4), "token_ids": torch.tensor([1, 2])}, str(tmp_path / "a.safetensors"))
    assert read_states(tmp_path / "a.safetensors")["token_ids"].tolist() == [1, 2]
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.real
@pytest.mark.slow
def test_vllm_engine_features_equal_the_hook_capture_on_smollm2(tmp_path, capsys):
    """A real `vllm serve` (the pinned CPU environment, eaglekit's connector) captures SmolLM2's features for
    the same samples as the hooks: same tokens and masks; taps and ``last`` within bf16 rounding. Both sides
    run fp32 (vLLM's kernels and transformers' round differently in the last fp32 bits, amplified over 30
    layers), then round to bf16, whose steps are 2^-8..2^-7 of a value: rtol = 2^-7 (one bf16 step) admits
    two fp32 values on either side of a rounding boundary; atol covers values near zero, where a step is tiny
    and the fp32 difference itself shows."""
    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare
    from eaglekit.engines import vllm_cpu

    vllm_cpu.require()
    common = ["target=smollm2-135m-instruct", "data=sharegpt", "num_conversations=4", "max_length=192",
              "progress=false", "draft_vocab_size=2000", "engine_threads=1"]
    for engine in ("hooks", "vllm"):
        run_prepare(load_config(PrepareConfig, None, [*common, f"output_dir={tmp_path / engine}",
                                                      f"capture_engine={engine}"]))
    assert_same_shards(tmp_path / "hooks", tmp_path / "vllm")
    assert not list((tmp_path / "vllm" / "engine-states").rglob("*.safetensors"))  # every file read and removed


def assert_same_shards(hooks_dir: Path, engine_dir: Path) -> None:
    """The engine's shards are the hooks': the same samples, tokens, masks and offsets; taps and ``last`` within
    bf16 rounding (rtol one bf16 step, 2^-7; atol for values near zero, where the fp32 difference itself shows)."""
    hooks, vllm = _shards(hooks_dir), _shards(engine_dir)
    assert hooks.keys() == vllm.keys() and hooks
    for name, ref in hooks.items():
        for key in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(vllm[name][key], ref[key]), key
        for key in ("taps", "last"):
            a, b = vllm[name][key].float(), ref[key].float()
            print(key, "max abs", (a - b).abs().max().item(), "equal", (a == b).float().mean().item())
            torch.testing.assert_close(a, b, rtol=2**-7, atol=2e-3, msg=f"{name} {key}")


@pytest.mark.slow
def test_vllm_engine_captures_a_hybrid_target_as_the_hooks_do(tmp_path):
    """A hybrid (a tiny random Nemotron-H: Mamba-2, attention and MLP blocks; widths in the multiples of 64 vLLM's
    CPU kernels take) captured by a real `vllm serve` in fp32 and by the hooks: the same samples, tokens and masks,
    taps and ``last`` within bf16 rounding (as on SmolLM2 above)."""
    import transformers
    from arch_matrix import BASE, FAMILIES, FAMILY_LAYERS
    from helpers import tiny_conversations, tiny_tokenizer

    from eaglekit.config import load_config
    from eaglekit.data_prep.prepare import PrepareConfig, run_prepare
    from eaglekit.engines import vllm_cpu

    vllm_cpu.require()
    arch = FAMILIES["nemotron_h"]
    cfg = transformers.NemotronHConfig(**{**BASE, "num_hidden_layers": FAMILY_LAYERS, **arch.kw, "head_dim": 64,
                                          "ssm_state_size": 32, "architectures": [arch.model_class]})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "target")
    tiny_tokenizer(512).save_pretrained(tmp_path / "target")
    tiny_conversations(tmp_path / "convs.jsonl", n=4)
    common = [f"target={tmp_path / 'target'}", f"data={tmp_path / 'convs.jsonl'}", "num_conversations=0",
              "max_length=64", "progress=false", "draft_vocab_size=64", "engine_threads=1"]
    for engine in ("hooks", "vllm"):
        run_prepare(load_config(PrepareConfig, None, [*common, f"output_dir={tmp_path / engine}",
                                                      f"capture_engine={engine}"]))
    assert_same_shards(tmp_path / "hooks", tmp_path / "vllm")


def test_a_file_the_engine_never_writes_is_an_error_not_a_hang(tmp_path):
    import fcntl

    named = tmp_path / "r.safetensors"
    lock = tmp_path / "r.safetensors.lock"
    lock.touch()  # the stock connector on a CPU: the lock made, the write failed
    with pytest.raises(EngineError, match="wrote no file"):
        read_states(named, timeout=1)
    with open(lock) as held:  # a writer still holding its exclusive lock
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(EngineError, match="did not finish writing"):
            read_states(named, timeout=0.05)
