"""`forked_cli.ForkedCommandLines`, which the slow tier's bad-input cases run through: each command line's exit code,
stdout and stderr as a process of its own would give them, whatever the module does."""

from __future__ import annotations

import subprocess
import sys

import pytest
from forked_cli import ForkedCommandLines

PROGRAM = """
import os
import sys

action = sys.argv[1]
print("argv", sys.argv[1:], "cwd first on the path:", sys.path[0] == os.getcwd())
print("to stderr", file=sys.stderr)
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "raise":
    raise ValueError("raised by the program")
if action == "hang":
    import time

    time.sleep(60)
if action == "stdin":
    print("stdin read:", repr(sys.stdin.read()))
if action == "set-global":
    os.environ["LEFT_BEHIND"] = "yes"
if action == "read-global":
    print("left behind:", os.environ.get("LEFT_BEHIND"))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("forked")
    (where / "program.py").write_text(PROGRAM)
    forked = ForkedCommandLines("program", preload=("json",), cwd=where)
    yield forked
    forked.close()


def test_a_normal_end_exits_0_with_both_outputs(server):
    result = server.run(["nothing"], timeout=30)
    assert result.returncode == 0
    assert result.stdout == "argv ['nothing'] cwd first on the path: True\n"
    assert result.stderr == "to stderr\n"
    assert result.args == [sys.executable, "-m", "program", "nothing"]


def test_sys_exit_gives_its_code(server):
    assert server.run(["exit", "3"], timeout=30).returncode == 3


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(server):
    result = server.run(["raise"], timeout=30)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and result.stderr.rstrip().endswith("ValueError: raised by the program")


def test_a_child_that_does_not_end_is_killed_and_reported_as_a_timeout(server):
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(["hang"], timeout=1)
    assert server.run(["exit", "4"], timeout=30).returncode == 4  # the server goes on


def test_stdin_is_empty_and_one_child_leaves_nothing_to_the_next(server):
    assert "stdin read: ''" in server.run(["stdin"], timeout=30).stdout
    server.run(["set-global"], timeout=30)
    assert "left behind: None" in server.run(["read-global"], timeout=30).stdout
