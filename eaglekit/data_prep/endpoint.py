"""A small client for OpenAI-compatible chat-completions servers (vLLM, SGLang, TGI, llama.cpp, ``transformers
serve``), stdlib only.

Requests send ``messages``, so the server applies the model's own chat template. A request that fails
in a way a retry can fix (connection refused or reset, timeout, HTTP 429 or 5xx) is retried with
exponential backoff a bounded number of times; then, or at once for any other HTTP error, one
EndpointError names the endpoint and the last failure. ``TransformersServe`` runs a local
``transformers serve`` (the ``serving`` extra) for tests and benchmarks.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from eaglekit.engines.server import free_port

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
MAX_DELAY = 30.0  # seconds: the longest wait between two tries


class EndpointError(RuntimeError):
    """The server could not be reached, or refused a request; the message names the endpoint."""


class ChatEndpoint:
    """``base_url`` ends in ``/v1`` (``http://HOST:PORT/v1``); ``model`` "" = the first id of GET /models.

    Thread-safe: one instance serves every worker thread. ``stop()`` makes sleeping retries give up, so
    the other workers end quickly once one of them has failed.
    """

    def __init__(
        self, base_url: str, model: str = "", timeout: float = 600.0, retries: int = 5, backoff: float = 0.5
    ):
        if not base_url.startswith(("http://", "https://")):
            raise EndpointError(
                f"regenerate.endpoint {base_url!r} is not an http(s):// URL (e.g. http://HOST:8000/v1)"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._stopped = threading.Event()
        self._model = model

    @property
    def model(self) -> str:
        if not self._model:
            ids = [m.get("id") for m in self._request("GET", "/models").get("data", [])]
            if not ids or not ids[0]:
                raise EndpointError(f"{self.base_url}/models lists no model; set regenerate.model")
            self._model = ids[0]
        return self._model

    def stop(self) -> None:
        self._stopped.set()

    def chat(
        self,
        messages: list[dict],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        item: str = "",
    ) -> str:
        """The assistant's answer to ``messages`` (stripped); temperature 0 asks for greedy decoding.
        ``item`` names what is asked (e.g. ``conversation 'c3'``) in an error."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if temperature > 0:
            body["top_p"] = top_p
            if seed is not None:
                body["seed"] = seed
        reply = self._request("POST", "/chat/completions", body, item)
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise EndpointError(
                f"{self.base_url}/chat/completions{_for(item)}: unexpected reply {str(reply)[:200]}"
            ) from None
        return (content or "").strip()

    def _request(self, method: str, path: str, body: dict | None = None, item: str = "") -> dict:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        last, tries, stopped = "", 0, False
        for attempt in range(self.retries + 1):
            if attempt and self._stopped.wait(min(MAX_DELAY, self.backoff * 2 ** (attempt - 1))):
                stopped = True  # another worker failed: give up now
                break
            tries += 1
            req = urllib.request.Request(
                url, data=data, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {_text(e)}"
                if e.code not in RETRY_STATUS:
                    raise EndpointError(f"{url} refused the request{_for(item)} ({last})") from None
            except (
                urllib.error.URLError,
                OSError,
                http.client.HTTPException,
            ) as e:  # refused, reset, cut off
                last = str(getattr(e, "reason", e))
            except json.JSONDecodeError as e:
                raise EndpointError(f"{url} answered something that is not JSON{_for(item)} ({e.msg})") from None
        # the tries really made: a retry cut short by stop() was never sent
        why = "; stopped retrying: another request failed" if stopped else ""
        raise EndpointError(
            f"regeneration endpoint {url}{_for(item)} failed after {tries} {'try' if tries == 1 else 'tries'} "
            f"(last: {last}{why}); is the server running? Rerun to resume."
        )


def _for(item: str) -> str:
    return f" for {item}" if item else ""


def _text(err: urllib.error.HTTPError) -> str:
    try:
        return err.read().decode("utf-8", "replace")[:300]
    except OSError:
        return err.reason or ""


class TransformersServe:
    """``transformers serve MODEL`` on 127.0.0.1 in a process of its own (tests, benchmarks, a local run).

    ``start()`` waits (bounded) until /health answers and returns the ``/v1`` URL; ``kill()`` ends the
    server's whole process group with SIGKILL. As a context manager the server is always killed.
    ``threads`` > 0 caps the server's torch threads (OMP_NUM_THREADS): on a busy CPU, idle threads that
    spin-wait for their peers cost more than they bring.
    """

    def __init__(
        self,
        model: str | Path,
        port: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int = 0,
        extra_args: tuple[str, ...] = (),
    ):
        self.model, self.device, self.dtype, self.threads = str(model), device, dtype, threads
        self.extra_args = list(extra_args)  # more `transformers serve` options, e.g. --continuous-batching
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix="transformers-serve-", suffix=".log")[1])

    def start(self, wait_s: float = 300.0) -> str:
        exe = Path(sys.executable).with_name("transformers")  # the venv's console script
        cmd = [str(exe) if exe.exists() else "transformers", "serve", self.model, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--device", self.device, "--dtype", self.dtype, *self.extra_args]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads)) if self.threads else None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=2):
                    return self.url
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                time.sleep(0.3)
        self.kill()
        tail = self.log.read_text(errors="replace")[-2000:]
        raise EndpointError(
            f"transformers serve {self.model} did not come up on {self.url} in {wait_s:.0f} s:\n{tail}"
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the server and remove its log."""
        self.kill()
        self.log.unlink(missing_ok=True)
