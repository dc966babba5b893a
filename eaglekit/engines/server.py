"""What eaglekit's engines share: a server process on 127.0.0.1 (started in a process group of its own that
dies with its parent, ready when /health answers, ended whole), a free port, a command run to its end with a
clear error, the τ counts of a completion, and the plain copy of a GGUF-dequantised model folder that
llama.cpp's converter and vLLM both need."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def run(cmd: list[str], what: str, log=sys.stderr, env=None, error=RuntimeError, hint=None) -> None:
    """``cmd`` to its end; on failure, its output's tail to ``log`` and ``error`` naming ``what``, the last line
    of output and ``hint(output)``'s advice where it has some."""
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, check=False)
    if out.returncode != 0:
        print(out.stdout[-4000:], file=log)
        lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
        cause = lines[-1].strip() if lines else "no output"
        if hint is not None and (advice := hint(out.stdout)):
            cause += f" -- {advice}"
        raise error(f"{what} failed (exit {out.returncode}): {cause}\n"
                                       f"command: {' '.join(cmd[:6])} ...")


def stamped(root: Path, marker: str, stamp: str, executables) -> Path | None:
    """``root``, an engine's cached install, if its ``marker`` file (written last, so the install is whole) holds
    ``stamp`` and every path of ``executables`` under it is executable; else None."""
    try:
        ok = (root / marker).read_text().strip() == stamp
    except OSError:
        return None
    return root if ok and all(os.access(root / x, os.X_OK) for x in executables) else None


class DraftCounts:
    """τ from a completion's ``tokens`` and its accepted drafts (``accepted``), as eaglekit counts it."""

    @property
    def steps(self) -> int:
        """Target forwards after the prefill: each emits one token of its own besides the drafts it accepts
        (the first token comes from the prefill)."""
        return max(len(self.tokens) - 1 - self.accepted, 1)

    @property
    def tau(self) -> float:
        """Tokens per verify forward, counted as eaglekit's DecodeStats.tau (prefill not counted)."""
        return (len(self.tokens) - 1) / self.steps


@contextlib.contextmanager
def plain_model_dir(model_dir):
    """``model_dir`` itself, or — for a folder eaglekit dequantised from a GGUF file, whose config keeps
    ``quantization_config: {quant_method: gguf}`` although its weights are plain, and which llama.cpp's
    converter and vLLM both refuse — a temporary copy (links to the same files) whose config drops it."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") != "gguf":
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="eaglekit-plain-") as plain:
        for f in model_dir.iterdir():
            if f.name != "config.json":
                os.symlink(f.resolve(), Path(plain) / f.name)
        config.pop("quantization_config")
        (Path(plain) / "config.json").write_text(json.dumps(config, indent=2))
        yield Path(plain)


# Linux: PR_SET_PDEATHSIG makes the kernel SIGTERM the server when the process that started it dies, however
# it dies (kill -9 included, where no cleanup runs). It is set by a short Python step that then execs the server
# (the setting survives exec), not in a preexec_fn, which is unsafe in a process with threads (torch has them).
_PDEATHSIG = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
              "os.getppid() == 1 and sys.exit(1); os.execvp(sys.argv[1], sys.argv[1:])")


def dies_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` started so that it ends with the process that starts it (as is, off Linux)."""
    return [sys.executable, "-c", _PDEATHSIG, *cmd] if sys.platform.startswith("linux") else list(cmd)


def exit_status(code: int) -> str:
    """A process's return code in words: a negative code is the signal that ended it (SIGSEGV: a crash)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


def free_port() -> int:
    """A TCP port nothing holds on any address (a port bound on one interface only still blocks a wildcard bind,
    such as torch.distributed's store's, and a loopback connect does not see it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process on 127.0.0.1 as a context manager: started in a process group of its own, its
    output kept in a temporary file (``tail``), ready when GET /health answers 200 (bounded by ``timeout``),
    the whole group ended on close. Subclasses set ``self.cmd``, ``self.timeout`` and ``self.port``."""

    name, error, poll_s, env = "server", RuntimeError, 0.3, None
    proc = log = None

    def __enter__(self):
        self.log = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc = subprocess.Popen(dies_with_parent(self.cmd), stdout=self.log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
            self._wait_healthy()
        except BaseException:  # Ctrl-C included: in a session of its own the server would not get the SIGINT
            self.close()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise self.error(f"{self.name} exited ({exit_status(self.proc.returncode)}) at start: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(self.poll_s)
        raise self.error(f"{self.name} did not become healthy in {self.timeout:.0f} s: {self.tail()}")

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)  # the server and any child it started
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def tail(self, n: int = 3000) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read()[-n:]
