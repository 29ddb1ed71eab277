"""Run untrusted model-written Python in a child process with limits.

Isolation (`Limits.isolation`, default `auto`: the strongest this machine allows):

- `bwrap` (bubblewrap, Debian package `bubblewrap`): new mount, PID, network, IPC and UTS
  namespaces; the whole file system read-only, /tmp, /home, /root and /work replaced by empty
  tmpfs (the Python installation is bound back read-only when it lives there), and only the
  work directory writable; the program runs as the unprivileged user `nobody` (65534) with no
  capabilities and no_new_privs (through `setpriv` when the evaluator runs as root, else bwrap's
  own user namespace). Killing bwrap kills the namespace's init (`--die-with-parent`), and with it
  every descendant, `setsid` ones included.
- `unshare` (util-linux), when bwrap is missing or cannot run: network and PID namespaces
  (`--kill-child`: the PID namespace dies with the process the parent kills), the audit hook
  below for file writes, and the rlimits; `nobody` where the interpreter is readable by it.
- `none`: rlimits and the audit hook only (no namespaces); reported in `RunResult.extra`.

In every mode: a fresh temporary directory is the child's cwd, HOME and TMPDIR, deleted
afterwards; `resource.setrlimit` before any model code: CPU seconds, address space (memory), file
size (also caps stdout, which goes to a file), process count (`RLIMIT_NPROC`), no core dumps; a
wall-clock limit enforced by the parent; and a Python audit hook (PEP 578) that refuses sockets,
writes, directory handles and chdir outside the work dir, starting processes and ctypes. The hook is
a guard against ordinary code, not a boundary: the namespaces are.

Each run is labelled by the limit that stopped it: `timeout` (wall clock), `cpu_limit`, `memory`,
`output_limit`, `process_limit`, `refused` (an audit-hook rule), else `runtime_error` / `ok`.
Programs run as `python -I -S` (isolated: no user site, no PYTHONPATH).
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
    max_processes: int = 64  # RLIMIT_NPROC (per user: counts the sandbox user's processes)
    network_namespace: bool = True  # `unshare` mode: use `unshare -n` when available
    isolation: str = "auto"  # auto | bwrap | unshare | none
    audit_hook: bool = True  # off only to test the namespace layer on its own


@dataclass
class RunResult:
    """status: ok | runtime_error | timeout | cpu_limit | memory | output_limit | process_limit |
    refused (an audit-hook rule)."""

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
nproc = int(job["max_processes"])
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

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

# process creation without an audit event of its own, and foreign-function access
NO_IMPORT = {"_posixsubprocess", "_ctypes", "ctypes", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
for _m in NO_IMPORT:
    sys.modules.pop(_m, None)

def _inside(p):
    if isinstance(p, int):
        return True
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    full = os.path.realpath(os.path.join(root, os.fspath(p)))
    return full == root or full.startswith(root + os.sep)

def _refuse(what):
    raise PermissionError("sandbox: " + what)

def _is_dir(p):
    try:
        return not isinstance(p, int) and os.path.isdir(p)
    except (OSError, ValueError, TypeError):
        return False

def guard(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writing and not _inside(path):
            _refuse("write outside the sandbox directory refused: %r" % (path,))
        if not _inside(path) and ((flags or 0) & getattr(os, "O_DIRECTORY", 0) or _is_dir(path)):
            _refuse("directory handle outside the sandbox directory refused: %r" % (path,))
        return
    if event == "import" and args[0] in NO_IMPORT:
        _refuse("import of " + args[0] + " is not allowed")
    if event == "os.chdir":
        if not _inside(args[0]):
            _refuse("chdir outside the sandbox directory refused: %r" % (args[0],))
        return
    n = PATH_EVENTS.get(event)
    if n:
        for p in args[:n]:
            if p is not None and not _inside(p):
                _refuse("%s outside the sandbox directory refused: %r" % (event, p))
        return
    if event.startswith(BLOCKED):
        _refuse(event + " is not allowed")

import errno
def limit_hit(e):
    """Name the rlimit behind an exception on stderr's last line, for the parent's label."""
    tag = None
    if isinstance(e, MemoryError):
        tag = "memory"
    elif isinstance(e, OSError) and e.errno == errno.EFBIG:
        tag = "output_limit"
    elif isinstance(e, OSError) and e.errno == errno.EAGAIN:  # fork/clone beyond RLIMIT_NPROC
        tag = "process_limit"
    if tag:
        try:
            os.write(2, ("\nSANDBOX-LIMIT " + tag + "\n").encode())
        except OSError:
            pass

mode = job["mode"]
src = open(job["program"]).read()
code = compile((PRELUDE if mode == "functional" else "") + src, "solution.py", "exec")
result_path = os.path.join(root, "__result__.json")
if job["audit_hook"]:
    sys.addaudithook(guard)
sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
status = 0
if mode == "stdin":
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, g)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        traceback.print_exc()
        limit_hit(e)
        status = 1
    try:
        sys.stdout.flush()
    except BaseException as e:
        limit_hit(e)
        status = 1
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
        limit_hit(e)
        os._exit(1)
    with open(result_path, "w") as f:
        f.write(payload)
    os._exit(0)
'''


NOBODY = 65534
HIDDEN = ("/tmp", "/home", "/root", "/work", "/var/tmp", "/run", "/mnt", "/media", "/srv")


def interpreter() -> str:
    """The real interpreter behind this one (a venv's python is a link to it); the harness needs
    only the standard library."""
    return os.path.realpath(sys.executable)


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


@lru_cache(maxsize=1)
def pidns_prefix() -> tuple[str, ...]:
    """`unshare` with network and PID namespaces (`--kill-child`), or () where it cannot run."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    base = ("-n", "-p", "-f", "--kill-child", "-m", "--mount-proc")
    for flags in (base, ("-r", *base)):
        try:
            r = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return (exe, *flags)
    return ()


def _readable_by_all(path: str) -> bool:
    """Every folder above `path` is searchable by others and the file is readable (so `nobody`
    can start the interpreter)."""
    p = os.path.dirname(path)
    while p and p != "/":
        if not os.stat(p).st_mode & 0o001:
            return False
        p = os.path.dirname(p)
    return bool(os.stat(path).st_mode & 0o005)


def _setpriv(uid: int) -> tuple[str, ...]:
    exe = shutil.which("setpriv")
    if not exe:
        return ()
    return (exe, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs")


def bwrap_prefix(root: str) -> tuple[str, ...]:
    """The bubblewrap command line for a run whose work directory is `root`, or () without bwrap."""
    exe = shutil.which("bwrap")
    if not exe:
        return ()
    py_home = os.path.dirname(os.path.dirname(interpreter()))  # e.g. /root/.pyenv/versions/3.11.7
    # every namespace but the user one (root outside: setpriv needs the real uid map)
    cmd = [exe, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--ro-bind", "/", "/",
           "--dev", "/dev", "--proc", "/proc"]
    for d in HIDDEN:
        if os.path.isdir(d):
            cmd += ["--tmpfs", d]
    if any(py_home == d or py_home.startswith(d + "/") for d in HIDDEN):
        cmd += ["--ro-bind", py_home, py_home]
    cmd += ["--bind", root, root, "--chdir", root]
    if os.geteuid() == 0:  # root outside: setpriv drops to nobody, every capability and new privileges
        priv = _setpriv(NOBODY)
        if not priv:
            return ()
        return (*cmd, "--", *priv)
    return (*cmd, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL", "--")


@lru_cache(maxsize=1)
def bwrap_works() -> bool:
    """bubblewrap is installed and can build a sandbox here (some containers forbid it)."""
    root = tempfile.mkdtemp(prefix="cotserve-sbx-probe-")
    try:
        if os.geteuid() == 0:
            _give_to_nobody(root)
        prefix = bwrap_prefix(root)
        if not prefix:
            return False
        r = subprocess.run([*prefix, interpreter(), "-I", "-S", "-c", "open('p', 'w').write('ok')"],
                           capture_output=True, timeout=30)
        return r.returncode == 0 and open(os.path.join(root, "p")).read() == "ok"
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        shutil.rmtree(root, ignore_errors=True)


def isolation_mode(requested: str = "auto") -> str:
    """The mode a run gets: `auto` picks bwrap, else unshare, else none; an explicit mode that
    cannot run here is an error (never a silent downgrade)."""
    if requested not in ("auto", "bwrap", "unshare", "none"):
        raise ValueError(f"sandbox isolation {requested!r}: expected auto, bwrap, unshare or none")
    if requested == "auto":
        return "bwrap" if bwrap_works() else "unshare" if pidns_prefix() else "none"
    if requested == "bwrap" and not bwrap_works():
        raise RuntimeError("sandbox isolation bwrap: bubblewrap is missing or cannot run here "
                           "(apt-get install bubblewrap)")
    if requested == "unshare" and not pidns_prefix():
        raise RuntimeError("sandbox isolation unshare: unshare cannot create PID/network namespaces here")
    return requested


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
               "max_output_mb": limits.max_output_mb, "max_processes": limits.max_processes,
               "audit_hook": limits.audit_hook}
        job_path = os.path.join(root, "__job__.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        in_path, out_path, err_path = (os.path.join(root, n) for n in ("__stdin__", "__stdout__", "__stderr__"))
        with open(in_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        mode_used = isolation_mode(limits.isolation)
        if mode_used == "bwrap":
            prefix = bwrap_prefix(root)
        elif mode_used == "unshare":
            prefix = pidns_prefix() if limits.network_namespace else ()
            if os.geteuid() == 0 and _readable_by_all(interpreter()):
                prefix = (*prefix, *_setpriv(NOBODY))
        else:
            prefix = netns_prefix() if limits.network_namespace else ()
        if os.geteuid() == 0 and mode_used != "none":
            _give_to_nobody(root)
        cmd = [*prefix, interpreter(), "-I", "-S", "-c", HARNESS, job_path]
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
        netns = mode_used == "bwrap" or any(f in ("-n", "--net") for f in prefix)
        res = RunResult("ok", stdout, stderr, rc, extra={"netns": netns, "isolation": mode_used})
        cap = limits.max_output_mb * 1024 * 1024
        tag = _limit_tag(stderr)
        if timed_out:
            res.status = "timeout"
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            res.status = "cpu_limit"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
        elif rc in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or tag == "output_limit" or \
                max(_size(out_path), _size(err_path)) >= cap:
            res.status = "output_limit"
        elif rc != 0:
            res.status = ("refused" if "PermissionError: sandbox:" in stderr
                          else tag or ("memory" if "MemoryError" in stderr else "runtime_error"))
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


def _give_to_nobody(root: str) -> None:
    """The work dir and its files belong to the sandbox user; the dir is 0711 so that bwrap (root
    without capabilities by then) can enter it, and nobody else can list it."""
    for dirpath, _, files in os.walk(root):
        os.chown(dirpath, NOBODY, NOBODY)
        for f in files:
            os.chown(os.path.join(dirpath, f), NOBODY, NOBODY)
    os.chmod(root, 0o711)


def _limit_tag(stderr: str) -> str | None:
    for line in reversed(stderr.strip().splitlines()[-3:]):
        if line.startswith("SANDBOX-LIMIT "):
            return line.split()[1]
    return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


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
