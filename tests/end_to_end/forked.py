"""Commands run in processes forked from one that has imported torch, Lightning and Hydra.

A ``tlab-*`` command spends about 8 of its 9 seconds at a tiny budget importing; the README
test runs some 130 of them. ``Commands`` starts one server process per test worker
(``python forked.py``), which imports once, then forks a child for each command. The child
is a process of its own, as the shell would start: its own arguments, working directory,
environment (``PYTHONPATH`` put on ``sys.path`` as Python would at start), standard input,
output and error, exit status. It runs the console script's entry point, or the module of
``python -m``, as Python does; what the command starts in turn (a launcher's workers) are
processes of their own, with their own imports. Nothing here is the project's: the
console scripts come from the installed package's metadata.

The protocol: one JSON request a line on the server's stdin (``argv``, ``cwd``, ``env``,
``stdin``, ``out``, ``err``, ``timeout``), one JSON answer a line on its stdout
(``returncode``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

# what every command imports; modules that a command runs as ``python -m`` are left out
PRELOAD = (
    "torch",
    "lightning.pytorch",
    "torchmetrics",
    "torchvision",
    "hydra",
    "omegaconf",
    "transformers_lab.train",
    "transformers_lab.run.fit",
)


def run_program(argv: list[str]) -> int:
    """Run ``argv`` (``tlab-train ...``, ``python -m module ...``) in this process as its
    own process would; its exit status."""
    program, *args = argv
    try:
        if program == "python":
            if args[:1] != ["-m"] or len(args) < 2:
                raise SystemExit(f"forked.py runs python -m MODULE only, not {argv}")
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            (script,) = entry_points(group="console_scripts", name=program)
            # the script's path, as the shell gives it: a DDP launcher starts it again
            sys.argv = [str(Path(sys.executable).parent / program), *args]
            result = script.load()()
            if result not in (None, 0):
                raise SystemExit(result)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # what Python prints for an uncaught exception, and status 1
        traceback.print_exc()
        return 1
    return 0


def child(request: dict) -> None:
    """The forked process: the request's directory, environment and files; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # as Python starts: the script's folder (python -m: the working directory) first,
        # then PYTHONPATH's entries, then the rest (the server's own folder left out)
        paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        python_m = request["argv"][0] == "python"
        first = os.getcwd() if python_m else str(Path(sys.executable).parent)
        sys.path[:1] = [first, *(os.path.abspath(p) for p in paths)]
        with tempfile.TemporaryFile() as given:
            given.write(request.get("stdin", "").encode())
            given.seek(0)
            os.dup2(given.fileno(), 0)
        for fd, name in ((1, "out"), (2, "err")):
            target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = run_program(request["argv"])
        shutdown = getattr(threading, "_shutdown", None)  # as Python's exit: join threads
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing to flush
                stream.flush()
        os._exit(code)


def wait(pid: int, timeout: float) -> int:
    """The exit status of child ``pid`` (killed past ``timeout`` seconds: -9)."""
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:  # the child and whatever it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.02)


def serve() -> None:
    """Import once, then fork a child for each request on stdin."""
    for name in PRELOAD:
        __import__(name)
    answers = os.fdopen(os.dup(1), "w")
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # its own group, as a shell's job: a timeout kills it all
            child(request)
        answer = {"returncode": wait(pid, request.get("timeout", 900))}
        print(json.dumps(answer), file=answers, flush=True)


@dataclass
class Done:
    """What ``subprocess.run`` gives, for what the tests read of it."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class Commands:
    """A server (``serve``) for one test worker; ``run`` runs a command in a child of it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="forked-"))
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # each command has its own
        self.server = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**env, "PYTHONUNBUFFERED": "1"},
            text=True,
        )
        ready = self.server.stdout.readline()
        if not ready:
            raise RuntimeError("the command server did not start")
        self.count = 0

    def run(
        self, argv: list[str], cwd: Path, env: dict[str, str], stdin: str = "", timeout=900
    ) -> Done:
        self.count += 1
        out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdin": stdin}
        request.update(out=str(out), err=str(err), timeout=timeout)
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        answer = self.server.stdout.readline()
        if not answer:
            raise RuntimeError("the command server stopped")
        code = json.loads(answer)["returncode"]
        return Done(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


if __name__ == "__main__":
    serve()
