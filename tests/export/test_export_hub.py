"""Model card and Hub upload, against a local HTTP server that records what huggingface_hub sends."""
import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import yaml
from helpers import save_tiny, tiny_target

from eaglekit.export import model_card, push_head
from eaglekit.heads import HeadConfig, build_head

SECRET = "hf_eaglekitTESTtoken0123456789abcdef"


class FakeHub(BaseHTTPRequestHandler):
    """Answers the endpoints create_repo / upload_folder use; records requests and committed files."""

    def log_message(self, *args):  # keep the test output clean
        pass

    def _reply(self, code, payload):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.requests.append(("GET", self.path, dict(self.headers), b""))
        self._reply(404, {"error": "not found"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append(("POST", self.path, dict(self.headers), body))
        base = f"http://127.0.0.1:{self.server.server_port}"
        if self.path == "/api/repos/create":
            req = json.loads(body)
            self.server.created.append(req)
            return self._reply(200, {"url": f"{base}/{req['organization']}/{req['name']}"})
        if self.path == "/api/validate-yaml":
            return self._reply(200, {"errors": [], "warnings": []})
        if "/preupload/" in self.path:
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                     for f in json.loads(body)["files"]]
            return self._reply(200, {"files": files})
        if "/commit/" in self.path:
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.server.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            return self._reply(200, {"commitUrl": f"{base}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40,
                                     "pullRequestUrl": None})
        self._reply(404, {"error": f"unexpected {self.path}"})


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub.constants as hc

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.requests, server.created, server.files = [], [], {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def saved_head(tmp_path_factory):
    target = tiny_target(layers=8, hidden=32, vocab_size=64)  # taps [2, 4, 5]
    torch.manual_seed(0)
    cfg = HeadConfig.from_target(target, kind="eagle3", draft_vocab_size=16)
    cfg.target_name = "smollm2-135m-instruct"
    head = build_head(cfg, target)
    d = tmp_path_factory.mktemp("head") / "h"
    head.save_pretrained(d)
    return target, head, d


def front_matter(card):
    assert card.startswith("---\n")
    meta_text, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(meta_text), body


def test_export_model_card_yaml(saved_head):
    _, head, d = saved_head
    (d / "results.json").write_text(json.dumps({"tau": 2.75, "speedup": 1.9, "benchmark": "mt-bench",
                                                "device": "H100"}))
    try:
        from eaglekit.export.hub import read_results
        card = model_card(head.config, "me/smol-eagle3", "sglang", datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"],
                          results=read_results(d))
    finally:
        (d / "results.json").unlink()
    meta, body = front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the asset's Hub id, not its alias
    assert meta["library_name"] == "eaglekit" and "eagle3" in meta["tags"] and "speculative-decoding" in meta["tags"]
    assert meta["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    assert meta["acceptance_length"] == 2.75 and meta["speedup"] == 1.9
    # an sglang upload shows SGLang's command only (vLLM would read its eagle_config taps as layer inputs)
    assert "--speculative-algorithm EAGLE3" in body and 'load_head("me/smol-eagle3", target)' in body
    assert "vllm serve" not in body and "--speculative-draft-model-path me/smol-eagle3" in body
    _, vbody = front_matter(model_card(head.config, "me/v", "vllm"))
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in vbody and '"method": "eagle3"' in vbody
    assert "sglang" not in vbody
    meta2, body2 = front_matter(model_card(head.config, "me/x", "native"))
    assert "acceptance_length" not in meta2 and "Not measured" in body2
    meta3, body3 = front_matter(model_card(head.config, "me/x", "native", results={"eval_tau_sim": 2.345678}))
    assert meta3["simulated_acceptance_length"] == 2.346 and "acceptance_length" not in meta3 and "2.35" in body3


def test_export_push_uploads_files_and_hides_token(fake_hub, saved_head, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    target, _, d = saved_head
    res = push_head(d, "me/smol-eagle3", private=True, token=SECRET, datasets=["me/data"], target=target)
    assert sorted(fake_hub.files) == ["README.md", "config.json", "model.safetensors"] == res["files"]
    assert fake_hub.files["model.safetensors"] == (d / "model.safetensors").read_bytes()
    assert fake_hub.files["config.json"] == (d / "config.json").read_bytes()
    meta, _ = front_matter(fake_hub.files["README.md"].decode())
    assert meta["datasets"] == ["me/data"]
    assert len(fake_hub.created) == 1 and fake_hub.created[0]["name"] == "smol-eagle3"
    assert fake_hub.created[0]["organization"] == "me" and fake_hub.created[0]["visibility"] == "private"
    assert any("/preupload/" in r[1] for r in fake_hub.requests) and any("/commit/" in r[1] for r in fake_hub.requests)
    # the token went to the server (Authorization header) and nowhere else
    assert all(r[2].get("authorization") == f"Bearer {SECRET}" for r in fake_hub.requests if r[0] == "POST")
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    assert SECRET not in caplog.text and SECRET not in json.dumps(res)


def test_export_push_cli_dry_run_and_upload(fake_hub, saved_head, capsys, monkeypatch, tmp_path):
    from eaglekit.cli import main

    _, _, d = saved_head
    monkeypatch.setenv("HF_TOKEN", SECRET)
    tdir = save_tiny(tmp_path / "target", layers=8, hidden=32, vocab_size=64)
    # without --target the head's own target (the real SmolLM2) is loaded and the head refused for it
    assert main(["push", "--head", str(d), "--repo-id", "me/h", "--dry-run", "--target", str(tdir)]) == 0
    out = capsys.readouterr().out
    assert "README.md, config.json, model.safetensors" in out and "base_model:" in out
    assert fake_hub.requests == []  # a dry run touches nothing
    assert main(["push", "--head", str(d), "--repo-id", "me/h", "--private", "--target", str(tdir)]) == 0
    out = capsys.readouterr()
    assert sorted(fake_hub.files) == ["README.md", "config.json", "model.safetensors"]
    assert fake_hub.created[0]["visibility"] == "private"
    assert SECRET not in out.out + out.err


def test_export_load_head_from_hub_id(saved_head, monkeypatch, tmp_path):
    """A repo id goes through huggingface_hub.snapshot_download (HF_ENDPOINT / cache honoured); a local
    folder of the same name wins."""
    import huggingface_hub

    from eaglekit.export import load_head

    target, head, d = saved_head
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, token=None: calls.append(repo) or str(d))
    loaded = load_head("me/smol-eagle3", target)
    assert calls == ["me/smol-eagle3"] and loaded.config == head.config
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_head("no/such/folder", target)


@pytest.fixture
def no_saved_token(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def test_export_push_without_token_fails_before_any_request(fake_hub, saved_head, no_saved_token, capsys):
    from eaglekit.cli import main
    from eaglekit.export.hub import NO_TOKEN, PushError

    target, _, d = saved_head
    with pytest.raises(PushError, match="no Hugging Face token: set HF_TOKEN or run `hf auth login`"):
        push_head(d, "me/h", target=target)
    assert main(["push", "--head", str(d), "--repo-id", "me/h"]) == 2  # before loading the target
    assert NO_TOKEN in capsys.readouterr().err
    assert fake_hub.requests == []


def test_export_push_refused_connection_names_the_endpoint(saved_head, monkeypatch):
    import socket

    import huggingface_hub.constants as hc

    from eaglekit.export.hub import PushError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    target, _, d = saved_head
    with pytest.raises(PushError, match=rf"cannot reach the Hugging Face Hub at http://127.0.0.1:{port}"):
        push_head(d, "me/h", token=SECRET, target=target)


def test_export_push_reads_and_checks_the_head_before_any_request(fake_hub, saved_head, tmp_path):
    from safetensors.torch import load_file, save_file

    target, head, d = saved_head
    other = tiny_target(layers=10, hidden=32, vocab_size=64)
    with pytest.raises(ValueError, match="not trained for this target.*layer count"):
        push_head(d, "me/h", token=SECRET, target=other)
    bad = tmp_path / "bad"
    head.save_pretrained(bad)
    w = load_file(str(bad / "model.safetensors"))
    w["fc.weight"][0, 0] = float("nan")
    save_file(w, str(bad / "model.safetensors"))
    for layout in ("native", "vllm"):  # native uploads the files as they are: they are read first
        with pytest.raises(ValueError, match=rf"{bad}/model.safetensors: tensor 'fc.weight' holds 1 non-finite"):
            push_head(bad, "me/h", token=SECRET, target=target, layout=layout)
    with pytest.raises(ValueError, match="not a Hugging Face repo id"):  # a published card needs a Hub id
        push_head(d, "me/h", token=SECRET, target=target, verifier=str(tmp_path))
    assert fake_hub.requests == []
    res = push_head(d, "me/h", token=SECRET, target=target, layout="speculators", verifier="org/base")
    cfg = json.loads(fake_hub.files["config.json"])
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/base"
    assert front_matter(res["card"])[0]["base_model"] == "org/base"


def test_export_push_module_is_checked_before_any_request(fake_hub, saved_head):
    target, head, _ = saved_head
    with pytest.raises(ValueError, match="push: this head was not trained for this target"):
        head.push_to_hub("me/h", token=SECRET, target=tiny_target(layers=10, hidden=32, vocab_size=64))
    nan_head = build_head(head.config, target)
    with torch.no_grad():
        nan_head.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="push: tensor 'norm.weight' holds 1 non-finite"):
        push_head(nan_head, "me/h", token=SECRET, target=target)
    assert fake_hub.requests == []


@pytest.mark.parametrize("kind, layout, title, serve", [
    ("eagle1", "eagle1", "# EAGLE-1 draft head", ["EaModel.from_pretrained"]),
    ("eagle3", "speculators", "# EAGLE-3 draft head", ['"method": "eagle3"', '"num_speculative_tokens": 3',
                                                       "from speculators.models.eagle3 import Eagle3DraftModel"]),
    ("peagle", "speculators", "# P-EAGLE draft head", ['"method": "eagle3"', '"num_speculative_tokens": 4',
                                                       '"parallel_drafting": true',
                                                       "from speculators.models.peagle import PEagleDraftModel"]),
    ("dflash", "vllm", "# DFlash draft head", ['"method": "dflash"', '"num_speculative_tokens": 7']),
    ("dflash", "sglang", "# DFlash draft head", ["--speculative-algorithm DFLASH"]),
])
def test_export_model_card_names_each_kind_and_its_serve_command(kind, layout, title, serve):
    """Each kind's card is titled with the kind's own name (from its head class) and shows the command its
    engines take: a parallel drafter its block in one forward (P-EAGLE block 4, DFlash block 8 = 7 drafts),
    P-EAGLE with vLLM's method written out ("eagle3" + parallel_drafting), no EAGLE tree flags."""
    target = tiny_target(layers=8, hidden=32, vocab_size=64)
    cfg = HeadConfig.from_target(target, kind=kind, block_size={"peagle": 4, "dflash": 8}.get(kind))
    cfg.target_name = "smollm2-135m-instruct"
    meta, body = front_matter(model_card(cfg, "me/h", layout))
    assert body.lstrip().startswith(title) and kind in meta["tags"], body[:200]
    assert all(s in body for s in serve), body
    others = {"# EAGLE-1", "# EAGLE-3", "# P-EAGLE", "# DFlash"} - {title.split(" draft")[0]}
    assert not any(o + " " in body for o in others)
    if kind in ("peagle", "dflash"):  # the EAGLE tree options are not theirs
        assert "EAGLE3" not in body and "--speculative-eagle-topk" not in body
    if kind == "dflash":
        assert '"method": "eagle3"' not in body and '"parallel_drafting"' not in body
