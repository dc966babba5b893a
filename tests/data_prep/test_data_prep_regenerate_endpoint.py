"""Regeneration through an OpenAI-compatible server (a fake one here; a real ``transformers serve`` in the
real test) and multi-turn self-distillation (every turn conditioned on the target's own earlier answers)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglekit.data_prep.endpoint import ChatEndpoint, EndpointError
from eaglekit.data_prep.regenerate import RegenerateConfig, regenerate

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).resolve().parent


class FakeServer:
    """An OpenAI-style chat server in a thread. It answers ``ans<k> to <last user text>`` (k = the user
    turn's number), records every request body, and can be made slow, failing or refusing."""

    def __init__(self, delay=lambda body: 0.0, fail_first: int = 0, fail_after: int | None = None):
        self.bodies, self.done_order, self.delay = [], [], delay
        self.fail_first, self.fail_after = fail_first, fail_after
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake._reply(self, 200, {"object": "list", "data": [{"id": "fake-model"}]})

            def do_POST(self):
                fake._chat(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def _chat(self, handler, body):
        with self.lock:
            self.bodies.append(body)
            n = len(self.bodies)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            status, payload = self._answer(body, n)
        finally:
            with self.lock:
                self.in_flight -= 1  # before the reply: the client may send its next request at once
        self._reply(handler, status, payload)

    def _answer(self, body, n):
        if body["model"] == "no-such-model":
            return 404, {"error": "model no-such-model not found"}
        if n <= self.fail_first or (self.fail_after is not None and n > self.fail_after):
            return 503, {"error": "overloaded"}
        time.sleep(self.delay(body))
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        answer = "" if users[-1] == "say nothing" else f"ans{len(users)} to {users[-1]}"
        with self.lock:
            self.done_order.append(users[0])
        return 200, {"choices": [{"message": {"role": "assistant", "content": answer}}]}

    @staticmethod
    def _reply(handler, status, payload):
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def start(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def conversations(n: int = 10) -> list[dict]:
    """``q<i>`` questions; every third conversation has a second user turn, the second one a system prompt."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"original {i}"}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": f"q{i} again"}, {"role": "assistant", "content": "orig 2"}]
        if i == 1:
            msgs.insert(0, {"role": "system", "content": "be brief"})
        out.append({"id": f"c{i}", "messages": msgs})
    return out


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def later_first(body) -> float:
    """Earlier conversations answer more slowly, so they finish out of order."""
    i = int(body["messages"][-1]["content"].split()[0][1:])
    return 0.02 * ((10 - i) % 5)


def test_endpoint_regenerates_every_turn_in_input_order(tmp_path, fake):
    server = fake(delay=later_first)
    convs = conversations()
    cfg = RegenerateConfig(endpoint=server.url, concurrency=4, max_new_tokens=7)
    assert cfg.enabled  # an endpoint switches regeneration on
    got = lines(regenerate(None, convs, tmp_path / "out.jsonl", cfg, progress=False))
    assert [g["id"] for g in got] == [c["id"] for c in convs]  # in input order ...
    assert server.done_order != sorted(server.done_order, key=lambda q: int(q[1:]))  # ... though not done so
    assert 1 < server.most_in_flight <= 4
    for g, c in zip(got, convs):
        users = [m["content"] for m in c["messages"] if m["role"] == "user"]
        want = [m for m in c["messages"] if m["role"] == "system"]
        for k, u in enumerate(users, 1):
            want += [{"role": "user", "content": u}, {"role": "assistant", "content": f"ans{k} to {u}"}]
        assert g["messages"] == want and "regenerate_error" not in g
    # turn 2 was asked with the server's own turn-1 answer, not the data's
    second = [b["messages"] for b in server.bodies if len(b["messages"]) == 3]
    assert len(second) == 4 and all(m[1]["content"] == f"ans1 to {m[0]['content']}" for m in second)
    body = server.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 7 and body["temperature"] == 0.0
    assert "seed" not in body and "top_p" not in body  # greedy


def test_endpoint_sends_sampling_settings_and_model(tmp_path, fake):
    server = fake()
    cfg = RegenerateConfig(endpoint=server.url, model="m", temperature=0.7, top_p=0.9, seed=3, concurrency=1)
    regenerate(None, conversations(4), tmp_path / "out.jsonl", cfg, progress=False)
    sent = [(b["model"], b["temperature"], b["top_p"], b["seed"]) for b in server.bodies]
    # seed = config seed + conversation index + user turn's position (0, 2, ...)
    assert sent == [("m", 0.7, 0.9, s) for s in (3, 5, 4, 5, 6, 8)]


def test_endpoint_resumes_after_a_failure_without_loss_or_duplicates(tmp_path, fake):
    convs = conversations()
    full = regenerate(
        None, convs, tmp_path / "full.jsonl", RegenerateConfig(endpoint=fake().url), progress=False
    )
    # a server that starts failing mid-run: one clear error naming it; what was written is an in-order prefix
    dying = fake(fail_after=6, delay=later_first)
    out = tmp_path / "out.jsonl"
    cfg = RegenerateConfig(endpoint=dying.url, concurrency=3, retries=2)
    failed = rf"{dying.url}/chat/completions for conversation 'c\d' failed after 3 tries .*503"  # names the item
    with pytest.raises(EndpointError, match=failed):
        regenerate(None, convs, out, cfg, progress=False)
    kept = out.read_text().splitlines()
    assert 0 < len(kept) < len(convs) and kept == full.read_text().splitlines()[: len(kept)]
    out.write_text(out.read_text() + '{"id": "c')  # and a line torn by a kill
    healthy = fake()
    regenerate(None, convs, out, RegenerateConfig(endpoint=healthy.url, concurrency=3), progress=False)
    assert out.read_bytes() == full.read_bytes()
    first_user = lambda messages: next(m["content"] for m in messages if m["role"] == "user")
    asked = {first_user(b["messages"]) for b in healthy.bodies}
    assert sorted(asked) == sorted(first_user(c["messages"]) for c in convs[len(kept) :])  # only the missing
    with pytest.raises(ValueError, match="other conversations"):
        regenerate(None, convs[1:], out, RegenerateConfig(endpoint=healthy.url), progress=False)


def test_endpoint_under_a_launcher_writes_the_one_process_file(tmp_path, fake):
    server = fake(delay=later_first)
    convs = conversations()
    cfg = RegenerateConfig(endpoint=server.url, batch_size=3, concurrency=2)
    full = regenerate(None, convs, tmp_path / "full.jsonl", cfg, progress=False)
    two = tmp_path / "two.jsonl"
    regenerate(None, convs, two, cfg, progress=False, rank=1, world_size=2, wait=False)
    assert [g["id"] for g in lines(tmp_path / "two.part1-of-2.jsonl")] == ["c3", "c4", "c5", "c9"]
    regenerate(None, convs, two, cfg, progress=False, rank=0, world_size=2)
    assert two.read_bytes() == full.read_bytes() and not list(tmp_path.glob("two.part*"))


class FakeClock:
    """Stands in for the endpoint's backoff wait (``threading.Event``, which ``stop()`` interrupts): each wait
    returns at once, records its length and moves a fake clock on by it; a set event returns True at once."""

    def __init__(self):
        self.now, self.waits, clock = 0.0, [], self

        class Event(threading.Event):
            def wait(self, timeout=None):
                if self.is_set() or timeout is None:
                    return super().wait(timeout)
                clock.waits.append(timeout)
                clock.now += timeout
                return False

        self.Event = Event


@pytest.fixture
def clock(monkeypatch):
    """The endpoint module's ``threading`` with a fake-clock Event (other modules keep the real one)."""
    import types

    from eaglekit.data_prep import endpoint

    fake_clock = FakeClock()
    monkeypatch.setattr(endpoint, "threading", types.SimpleNamespace(**{**vars(threading), "Event": fake_clock.Event}))
    return fake_clock


def test_endpoint_retries_then_gives_one_clear_error(tmp_path, fake, clock):
    from eaglekit.data_prep.endpoint import MAX_DELAY

    flaky = fake(fail_first=2)  # two 503s, then answers: retried with backoff 0.5 s, then 1 s
    out = regenerate(
        None,
        conversations(2),
        tmp_path / "a.jsonl",
        RegenerateConfig(endpoint=flaky.url, retries=2, concurrency=1),
        progress=False,
    )
    assert len(lines(out)) == 2 and len(flaky.bodies) == 2 + 3
    assert clock.waits == [0.5, 1.0]
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    clock.waits.clear()
    # the first request is the model lookup: the error names the URL that failed
    with pytest.raises(EndpointError, match=rf"endpoint {url}/models failed after 3 tries \(last: .*refused"):
        regenerate(
            None,
            conversations(2),
            tmp_path / "b.jsonl",
            RegenerateConfig(endpoint=url, retries=2, concurrency=1),
            progress=False,
        )
    assert clock.waits == [0.5, 1.0]  # doubling from 0.5 s, then one clear error
    # a long run of failures: the wait doubles up to MAX_DELAY and stays there
    clock.waits.clear()
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(EndpointError, match=rf"{url}/chat/completions for conversation 'c7' failed after 9 tries"):
        ChatEndpoint(url, model="m", retries=8).chat(hi, max_tokens=1, item="conversation 'c7'")
    assert clock.waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_DELAY, MAX_DELAY] and MAX_DELAY == 30.0
    # stop() (another worker failed) ends a sleeping retry at once, after the try in flight
    stopped = ChatEndpoint(url, model="m", retries=8)
    stopped.stop()
    clock.waits.clear()
    with pytest.raises(EndpointError, match=r"failed after 1 try \(last: .*refused.*; stopped retrying"):
        stopped.chat(hi, max_tokens=1)  # the count is the tries made: the retry stop() cut short was never sent
    assert clock.waits == []
    with pytest.raises(EndpointError, match=r"failed after 1 try \(last: .*refused[^;]*\); is the server"):
        ChatEndpoint(url, model="m", retries=0).chat(hi, max_tokens=1)  # no retries: one try, said so
    bad = RegenerateConfig(endpoint=flaky.url, model="no-such-model", retries=5, concurrency=1)
    n = len(flaky.bodies)
    with pytest.raises(EndpointError, match="refused the request .*HTTP 404.*no-such-model not found"):
        # one conversation: with two, the pool's worker may start the second before the first's error stops it
        regenerate(None, conversations(1), tmp_path / "c.jsonl", bad, progress=False)
    assert len(flaky.bodies) == n + 1  # a 4xx is not retried (retries=5 would make it 6)
    with pytest.raises(EndpointError, match="not an http"):
        ChatEndpoint("localhost:8000/v1")


def test_endpoint_stops_a_conversation_at_a_too_long_prompt_or_empty_answer(tmp_path, fake):
    from helpers import tiny_target

    server = fake()
    convs = conversations(1)
    convs[0]["messages"][0]["content"] = "q0 " + "x" * 20
    convs.append(
        {"id": "quiet", "messages": [{"role": "user", "content": "say nothing"}, convs[0]["messages"][1]]}
    )
    cfg = RegenerateConfig(endpoint=server.url, max_prompt_tokens=40)  # the tiny tokenizer: a token a char
    got = lines(regenerate(tiny_target(), convs, tmp_path / "out.jsonl", cfg, progress=False))
    assert [m["role"] for m in got[0]["messages"]] == ["user", "assistant"]  # turn 2 did not fit
    assert "max_prompt_tokens" in got[0]["regenerate_error"] and len(server.bodies) == 2
    assert got[1]["messages"] == [] and "empty answer" in got[1]["regenerate_error"]


KILL_SCRIPT = r"""
import sys
sys.path[:0] = [sys.argv[1]]
from test_data_prep_regenerate_endpoint import FakeServer, conversations
from eaglekit.data_prep.regenerate import RegenerateConfig, regenerate
server = FakeServer(delay=lambda body: 0.15)
regenerate(None, conversations(), sys.argv[2], RegenerateConfig(endpoint=server.url, concurrency=2), progress=False)
"""


def test_endpoint_resumes_after_kill_9(tmp_path, fake):
    convs = conversations()
    full = regenerate(
        None, convs, tmp_path / "full.jsonl", RegenerateConfig(endpoint=fake().url), progress=False
    )
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(HERE), str(out)])
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") >= 3) and time.monotonic() < deadline:
            assert proc.poll() is None, "the regeneration ended before it could be killed"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 3 <= out.read_text().count("\n") < len(convs)
    regenerate(None, convs, out, RegenerateConfig(endpoint=fake().url, concurrency=3), progress=False)
    assert out.read_bytes() == full.read_bytes()


def test_prepare_regenerates_through_an_endpoint_up_to_max_turns(tmp_path, fake, monkeypatch):
    """Through a server with no capture, prepare loads the target without its decoder (the server runs it)."""
    from helpers import save_tiny

    from eaglekit.cli import main
    from eaglekit.data_prep import prepare

    loads, load = [], prepare.load_target_from
    monkeypatch.setattr(prepare, "load_target_from", lambda *a, **k: loads.append(k) or load(*a, **k))
    server = fake()
    data = tmp_path / "convs.jsonl"
    msgs = [{"role": r, "content": f"{r[0]}{k}"} for k in range(3) for r in ("user", "assistant")]
    data.write_text(json.dumps({"id": "a", "messages": msgs}) + "\n")
    rc = main(
        [
            "prepare",
            f"target={save_tiny(tmp_path / 'tiny')}",
            f"data={data}",
            f"output_dir={tmp_path / 'p'}",
            "max_turns=2",
            "capture=false",
            "progress=false",
            "draft_vocab_size=20",
            f"regenerate.endpoint={server.url}",
            "regenerate.concurrency=2",
        ]
    )
    assert rc == 0 and loads == [{"decoder": False}]
    got = lines(tmp_path / "p" / "regenerated.jsonl")
    assert [m["content"] for m in got[0]["messages"]] == ["u0", "ans1 to u0", "u1", "ans2 to u1"]


def test_in_process_turn_two_is_asked_with_the_regenerated_turn_one(tmp_path):
    from helpers import tiny_target

    target = tiny_target()
    prompts = []
    template = target.tokenizer.apply_chat_template

    def spy(messages, *args, **kw):
        prompts.append([dict(m) for m in messages])
        return template(messages, *args, **kw)

    target.tokenizer.apply_chat_template = spy
    convs = [c for c in conversations(4) if len(c["messages"]) == 4]  # two user turns each
    got = lines(
        regenerate(target, convs, tmp_path / "out.jsonl", RegenerateConfig(max_new_tokens=5), progress=False)
    )
    second = [p for p in prompts if len(p) == 3]
    assert len(second) == len(convs)
    for p, g, c in zip(second, got, convs):
        assert p[1] == g["messages"][1] != c["messages"][1]  # the target's own answer, not the data's
        assert p[2] == c["messages"][2] and g["messages"][3]["content"]


def short_conversations() -> list[dict]:
    """Five one-line questions; the first and the last get a second user turn."""
    questions = ["What is 2+2?", "Name a colour.", "Say hi.", "Name a fruit.", "Spell cat."]
    convs = []
    for i, q in enumerate(questions):
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": "no idea"}]
        if i % 4 == 0:
            msgs += [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "because"}]
        convs.append({"id": f"q{i}", "messages": msgs})
    return convs


@pytest.mark.real
@pytest.mark.slow
def test_transformers_serve_regeneration_survives_a_killed_server(tmp_path, smollm2):
    """A real ``transformers serve`` of the embedded SmolLM2: killed (SIGKILL) mid-run, restarted on the same
    port, the rerun completes the file with every conversation once, in input order, each turn conditioned on
    the server's own earlier answer."""
    pytest.importorskip("uvicorn", reason="needs the serving extra: pip install -e '.[serving]'")
    from test_data_prep_prepare import _greedy

    from eaglekit.assets import model_dir
    from eaglekit.data_prep.endpoint import TransformersServe

    convs = short_conversations()
    server = TransformersServe(model_dir("smollm2-135m-instruct"), threads=1)  # see TransformersServe
    out = tmp_path / "out.jsonl"
    cfg = RegenerateConfig(endpoint=server.url, concurrency=1, max_new_tokens=8, retries=1)
    errors = []
    try:
        server.start()
        worker = threading.Thread(
            target=lambda: _catch(errors, regenerate, None, convs, out, cfg, progress=False)
        )
        worker.start()
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        server.kill()
        worker.join(60)
        assert len(errors) == 1 and isinstance(errors[0], EndpointError) and server.url in str(errors[0])
        kept = out.read_text().splitlines()
        assert 2 <= len(kept) < len(convs)
        server.start()  # the same port again
        regenerate(None, convs, out, cfg, progress=False)
        got = lines(out)
        assert out.read_text().splitlines()[: len(kept)] == kept
        assert [g["id"] for g in got] == [c["id"] for c in convs]  # nothing lost, nothing twice, in order
        for g, c in zip(got, convs):
            assert "regenerate_error" not in g and len(g["messages"]) == len(c["messages"])
            assert all(m["content"] for m in g["messages"])
        # the server applied SmolLM2's own template: its greedy answer is the in-process greedy answer
        assert got[1]["messages"][1]["content"] == _greedy(smollm2, convs[1]["messages"][:1], 8)
        # turn 2 was conditioned on the server's own turn-1 answer
        client = ChatEndpoint(server.url)
        assert got[0]["messages"][3]["content"] == client.chat(got[0]["messages"][:3], max_tokens=8)
        assert got[0]["messages"][3]["content"] != client.chat(convs[0]["messages"][:3], max_tokens=8)
    finally:
        server.close()


def _catch(errors: list, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - handed to the test thread
        errors.append(e)
