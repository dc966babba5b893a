"""Every CLI error is one line, ``eaglekit: error: ...``, exit 2; EAGLEKIT_DEBUG=1 adds the traceback."""
import os
import subprocess
import sys

import pytest

from eaglekit import cli
from eaglekit.cli import main


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv,message", [
    (["train", "data.conversations=x", "optim.bf16=maybe"], "override: optim.bf16 must be true or false, got 'maybe'"),
    (["train", "data.conversations=x", "head=5"], "override: head must be a section of keys (kind, "),
    (["prepare", "--config", "/nonexistent/run.yaml"], "/nonexistent/run.yaml: config file not found"),
    (["prepare", "max_length=0"], "override: max_length must be an int >= 1, got 0"),
    (["generate", "target=/nonexistent", "prompt="], "prompt= is empty"),
    (["generate", "target=/nonexistent", "prompt=   "], "prompt= is empty"),
    (["generate", "target=/nonexistent", "dtype=float8"], "dtype must be one of 'float32', 'bfloat16', 'float16'"),
    (["bench", "target=/nonexistent", "prompts=0"], "override: prompts must be an int >= 1, got 0"),
    (["bench", "target=/nonexistent", "prompts=-2"], "override: prompts must be an int >= 1, got -2"),
    (["bench", "target=/nonexistent", "repeats=0"], "override: repeats must be an int >= 1, got 0"),
    (["bench", "target=/nonexistent", "temperatures=[]"], "temperatures must be a list of floats >= 0 (at least 1 item) (e.g. [0.0, 1.0]), got []"),
    (["bench", "target=/nonexistent", "dataset=gsm8k"], "dataset must be one of 'mt-bench', 'humaneval'"),
    (["export", "--head", "x"], "eaglekit export: --head and --out are required"),  # SystemExit("...")
])
def test_user_errors_are_one_line_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("EAGLEKIT_DEBUG", raising=False)
    assert main(argv) == 2  # refused before any model is loaded (target=/nonexistent is never opened)
    line = one_line(capsys)
    assert line.startswith("eaglekit: error: ") and message in line, line


def test_a_bug_is_one_line_naming_its_type_and_the_debug_switch(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli, "command", lambda spec: type("Cmd", (), {"run": staticmethod(broken)}))
    monkeypatch.delenv("EAGLEKIT_DEBUG", raising=False)
    assert main(["generate"]) == 2
    assert one_line(capsys) == ("eaglekit: error: RuntimeError: boom second line (an unexpected error, please "
                                "report it; EAGLEKIT_DEBUG=1 shows the traceback)")
    monkeypatch.setenv("EAGLEKIT_DEBUG", "1")
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in broken" in err
    assert err.strip().splitlines()[-1] == "eaglekit: error: RuntimeError: boom second line (an unexpected error, " \
                                           "please report it)"


def test_usage_errors_and_help_keep_argparse_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0


def test_run_with_errors_wraps_any_entry_point(capsys):
    def entry(path):
        raise FileNotFoundError(f"{path}: no such run config")

    assert cli.run_with_errors(entry, "a.yaml") == 2
    assert one_line(capsys) == "eaglekit: error: a.yaml: no such run config"
    assert cli.run_with_errors(lambda: 3) == 3 and cli.run_with_errors(lambda: None) == 0


def test_console_command_prints_one_line_and_exits_2():
    cmd = [sys.executable, "-m", "eaglekit.cli", "bench", "target=/nonexistent", "prompts=0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2 and res.stderr == "eaglekit: error: override: prompts must be an int >= 1, got 0\n"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "EAGLEKIT_DEBUG": "1"})
    assert res.returncode == 2 and "Traceback (most recent call last)" in res.stderr
    assert res.stderr.strip().splitlines()[-1] == "eaglekit: error: override: prompts must be an int >= 1, got 0"
