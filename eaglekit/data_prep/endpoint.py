"""A small client for OpenAI-compatible chat-completions servers (vLLM, SGLang, TGI, llama.cpp, ``transformers
serve``), stdlib only.

Requests send ``messages``, so the server applies the model's own chat template. A request that fails
in a way a retry can fix (connection refused or reset, timeout, HTTP 429 or 5xx) is retried with
exponential backoff a bounded number of times; then, or at once for any other HTTP error, one
EndpointError names the endpoint and the last failure.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request

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
    ) -> str:
        """The assistant's answer to ``messages`` (stripped); temperature 0 asks for greedy decoding."""
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
        reply = self._request("POST", "/chat/completions", body)
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise EndpointError(
                f"{self.base_url}/chat/completions: unexpected reply {str(reply)[:200]}"
            ) from None
        return (content or "").strip()

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt and self._stopped.wait(min(MAX_DELAY, self.backoff * 2 ** (attempt - 1))):
                break  # another worker failed: give up now
            req = urllib.request.Request(
                url, data=data, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {_text(e)}"
                if e.code not in RETRY_STATUS:
                    raise EndpointError(f"{url} refused the request ({last})") from None
            except (
                urllib.error.URLError,
                OSError,
                http.client.HTTPException,
            ) as e:  # refused, reset, cut off
                last = str(getattr(e, "reason", e))
            except json.JSONDecodeError as e:
                raise EndpointError(f"{url} answered something that is not JSON ({e.msg})") from None
        raise EndpointError(
            f"regeneration endpoint {self.base_url} failed after {attempt + 1} tries (last: {last}); "
            "is the server running? Rerun to resume."
        )


def _text(err: urllib.error.HTTPError) -> str:
    try:
        return err.read().decode("utf-8", "replace")[:300]
    except OSError:
        return err.reason or ""
