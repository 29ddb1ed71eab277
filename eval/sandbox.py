"""Run untrusted model-written Python in a child process with limits.

Layers, each independent of the others:

- a fresh temporary directory is the child's cwd, HOME and TMPDIR, and is deleted afterwards;
- `resource.setrlimit` in the child before any model code: CPU seconds, address space (memory),
  file size (also caps stdout, which goes to a file), no core dumps;
- a wall-clock limit enforced by the parent, which kills the child's whole process group;
- no network: the child runs in a new network namespace (`unshare -n`, or `unshare -rn` for a
  normal user) when the kernel allows it, and in any case
- a Python audit hook (PEP 578) installed before the model's code runs refuses: sockets, writes
  (open for writing, remove, rename, mkdir, chmod, ...) outside the temp dir, starting processes
  (subprocess, os.system, exec*, fork, spawn), signalling other processes, and ctypes.

The audit hook cannot be removed from inside the interpreter. It is a guard against accidents and
ordinary code, not a security boundary against a determined attacker; the namespace and rlimits
are the hard limits. Programs run as `python -I -S` (isolated: no user site, no PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any


@dataclass
class Limits:
    """Per-test limits. timeout_s is wall clock; the CPU limit is timeout_s + 1 (rounded up)."""

    timeout_s: float = 6.0
    memory_mb: int = 1024
    max_output_mb: int = 16
    network_namespace: bool = True  # use `unshare -n` when available


@dataclass
class RunResult:
    """status: ok | runtime_error | timeout | memory | output_limit | refused (a sandbox rule hit)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    value: Any = None  # functional mode: the returned value (JSON-decoded)
    extra: dict[str, Any] = field(default_factory=dict)


# The child's entry point. It reads its job from argv[1] (a JSON file in its temp dir), sets the
# rlimits, installs the audit hook, then runs the program. Only the standard library is used.
HARNESS = r'''
import sys, os, json, resource, io, traceback
job = json.load(open(sys.argv[1]))
root = os.path.realpath(job["root"])
cpu = int(job["cpu_s"])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
mem = job["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
out = job["max_output_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

# modules solutions commonly use, imported before the guard (reading is allowed anyway)
import collections, heapq, math, bisect, itertools, functools, string, re, typing, random, copy
import operator, statistics, fractions, decimal, array, datetime
PRELUDE = ("from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
           "from itertools import *\nfrom functools import *\nimport math, string, re, sys, heapq, bisect, "
           "collections, itertools, functools, random, copy, operator\n")

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
               "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1, "os.chflags": 1, "os.lchown": 1,
               "os.rename": 2, "os.link": 2, "os.symlink": 2, "shutil.move": 2, "shutil.copyfile": 2}
BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "os.kill", "os.killpg", "os.startfile", "pty.", "ctypes.", "_posixsubprocess",
           "os.putenv", "os.unsetenv", "resource.setrlimit", "resource.prlimit", "sys.remote_exec")

def _inside(p):
    if isinstance(p, int):
        return True
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    full = os.path.realpath(os.path.join(root, os.fspath(p)))
    return full == root or full.startswith(root + os.sep)

def _refuse(what):
    raise PermissionError("sandbox: " + what)

def guard(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writing and not _inside(path):
            _refuse("write outside the sandbox directory refused: %r" % (path,))
        return
    n = PATH_EVENTS.get(event)
    if n:
        for p in args[:n]:
            if p is not None and not _inside(p):
                _refuse("%s outside the sandbox directory refused: %r" % (event, p))
        return
    if event.startswith(BLOCKED):
        _refuse(event + " is not allowed")

mode = job["mode"]
src = open(job["program"]).read()
code = compile((PRELUDE if mode == "functional" else "") + src, "solution.py", "exec")
result_path = os.path.join(root, "__result__.json")
sys.addaudithook(guard)
sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
status = 0
if mode == "stdin":
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, g)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    os._exit(status)
else:
    real_stdout = sys.stdout
    sys.stdout = io.StringIO()  # the program's own prints are not the answer
    g = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(code, g)
        name = job["func_name"]
        fn = getattr(g["Solution"](), name) if "Solution" in g else g[name]
        value = fn(*job["args"])
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        payload = json.dumps({"value": value}, default=lambda o: list(o) if isinstance(o, (tuple, set)) else str(o))
    except BaseException as e:
        traceback.print_exc()
        os._exit(1)
    with open(result_path, "w") as f:
        f.write(payload)
    os._exit(0)
'''


@lru_cache(maxsize=1)
def netns_prefix() -> tuple[str, ...]:
    """The `unshare` command line that gives a child its own (empty) network namespace, or ()."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    for flags in (("-n",), ("-r", "-n")):
        try:
            r = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return (exe, *flags)
    return ()


def run_program(source: str, stdin: str = "", mode: str = "stdin", func_name: str | None = None,
                args: list[Any] | None = None, limits: Limits | None = None) -> RunResult:
    """Run `source` once. mode `stdin`: feed `stdin`, capture stdout. mode `functional`: call
    `Solution().func_name(*args)` (or a top-level `func_name`) and return its value."""
    limits = limits or Limits()
    root = os.path.realpath(tempfile.mkdtemp(prefix="cotserve-sbx-"))
    try:
        prog = os.path.join(root, "solution.py")
        with open(prog, "w", encoding="utf-8") as f:
            f.write(source)
        job = {"root": root, "program": prog, "mode": mode, "func_name": func_name, "args": args or [],
               "cpu_s": int(limits.timeout_s) + 1, "memory_mb": limits.memory_mb,
               "max_output_mb": limits.max_output_mb}
        job_path = os.path.join(root, "__job__.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        in_path, out_path, err_path = (os.path.join(root, n) for n in ("__stdin__", "__stdout__", "__stderr__"))
        with open(in_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        prefix = netns_prefix() if limits.network_namespace else ()
        cmd = [*prefix, sys.executable, "-I", "-S", "-c", HARNESS, job_path]
        timed_out = False
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            proc = subprocess.Popen(cmd, cwd=root, stdin=fin, stdout=fout, stderr=ferr, env=env,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                rc = proc.wait()
        stdout = _read(out_path)
        stderr = _read(err_path)
        res = RunResult("ok", stdout, stderr, rc, extra={"netns": bool(prefix)})
        if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
            res.status = "timeout"
        elif rc == -signal.SIGXFSZ:
            res.status = "output_limit"
        elif rc != 0:
            res.status = ("refused" if "PermissionError: sandbox:" in stderr
                          else "memory" if "MemoryError" in stderr else "runtime_error")
        elif mode == "functional":
            try:
                with open(os.path.join(root, "__result__.json"), encoding="utf-8") as f:
                    res.value = json.load(f)["value"]
            except (OSError, ValueError, KeyError):
                res.status = "runtime_error"
                res.stderr += "\nno result was returned"
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")
