"""`python -m MODULE ARGS...`, each in a process of its own, forked from one Python that has imported the heavy
third-party packages once.

A fresh `python -m stapo_trl train ...` spends most of its CPU time importing torch, transformers, TRL and PEFT
before it reads its input. `ForkedCommandLines` starts one server process (this file, run as a script) that imports
the packages in ``preload`` and then, for each command line it is sent, forks a child that runs the module as
``python -m`` would (``runpy.run_module(MODULE, run_name="__main__", alter_sys=True)``, the current directory first on
``sys.path``), with stdin from /dev/null and stdout and stderr to files of its own. The child ends as the interpreter
ends any program: an uncaught exception goes through ``sys.excepthook`` and exits 1, ``SystemExit`` gives its code,
atexit handlers run. The caller gets the exit code and both outputs, as from ``subprocess.run``.

What a fork cannot show: anything the preloaded packages print while they are imported (their import-time warnings
go to the server's stderr once, not to each child's). A fresh process shows those; keep some command lines in fresh
processes for that. Nor does the children's CPU time count against the test that ran them: it is the server's
children's, counted when the server ends (`tests/tiers.py` sees none of it; the whole pytest process's does).

usage (the server): python forked_cli.py MODULE PRELOAD[,PRELOAD...]; requests are JSON lines on stdin, answers JSON
lines on the stdout it had when it started.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY_PACKAGES = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "matplotlib")
"""What `python -m stapo_trl train ...` imports before it checks its recipe, and `report` before it reads a run."""


class ForkedCommandLines:
    """A server process that runs `python -m module ...` command lines, each in a child forked from it."""

    def __init__(self, module: str = "stapo_trl", preload=HEAVY_PACKAGES, env: dict | None = None, cwd=None):
        self.module = module
        self._scratch = tempfile.TemporaryDirectory(prefix="forked-cli-")
        self._server_log = Path(self._scratch.name) / "server.err"
        self._count = 0
        with self._server_log.open("w") as log:
            self._server = subprocess.Popen(
                [sys.executable, __file__, module, ",".join(preload)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                cwd=cwd,
            )

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run ``python -m module *argv`` in a forked child; raise `subprocess.TimeoutExpired` if it has not exited
        within ``timeout`` seconds (the child is killed), as `subprocess.run` does."""
        self._count += 1
        out = Path(self._scratch.name) / f"{self._count}.out"
        err = Path(self._scratch.name) / f"{self._count}.err"
        request = {"argv": list(argv), "out": str(out), "err": str(err), "timeout": timeout}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server stopped; its stderr:\n{self._server_log.read_text()[-4000:]}")
        answer = json.loads(line)
        command = [sys.executable, "-m", self.module, *argv]
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(command, answer["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._scratch.cleanup()


def _serve(preload: list[str]) -> dict | None:
    """The server's loop: returns a request in each forked child (which then runs it), None when stdin closes."""
    answers = os.dup(1)
    os.dup2(2, 1)  # what the imports print goes to stderr, not into the answers
    for name in preload:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            os.close(answers)
            return request
        deadline = time.monotonic() + request["timeout"]
        timed_out = False
        while True:
            finished, status = os.waitpid(child, os.WNOHANG)
            if finished:
                break
            if time.monotonic() > deadline:
                os.kill(child, signal.SIGKILL)
                _, status = os.waitpid(child, 0)
                timed_out = True
                break
            time.sleep(0.02)
        answer = {"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}
        os.write(answers, (json.dumps(answer) + "\n").encode())
    return None


def _become(request: dict, module: str) -> None:
    """In the forked child: stdin, stdout and stderr as `subprocess.run` would give them, then `python -m module`."""
    import runpy

    stdin = os.open(os.devnull, os.O_RDONLY)
    stdout = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stderr = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for source, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
        os.close(source)
    sys.argv = [module, *request["argv"]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` puts it, in place of this file's directory
    module_name, preloaded = sys.argv[1], [name for name in sys.argv[2].split(",") if name]
    forked_request = _serve(preloaded)
    if forked_request is not None:
        _become(forked_request, module_name)
