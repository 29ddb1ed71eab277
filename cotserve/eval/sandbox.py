"""Run untrusted model-written Python in a child process with limits.

Isolation (`Limits.isolation`, `--sandbox`), default `auto`:

- `bwrap` (bubblewrap, Debian package `bubblewrap`), which `auto` means: new mount, PID,
  network, IPC and UTS namespaces. The program sees only the system folders (`/usr`, `/etc` and
  the `/bin`, `/lib*` links), the Python installation, read-only, a fresh `/dev`, `/proc` and an
  empty `/tmp`, and its own work directory, the only writable place: nothing else of the host
  exists for it (no data directory, no outputs, no home). It runs as the unprivileged user
  `nobody` (65534) with no capabilities and no_new_privs (through `setpriv` when the evaluator
  runs as root, else bwrap's own user namespace). Killing bwrap kills the namespace's init
  (`--die-with-parent`), and with it every descendant, `setsid` ones included.
- When bubblewrap is missing or cannot run, `auto` (and `bwrap`) refuse with `SandboxError`:
  model-written code never runs with less isolation unless asked for by name.
- `unsafe-unshare` (util-linux): network and PID namespaces (`--kill-child`: the PID namespace
  dies with the process the parent kills), the audit hook below for file writes, and the
  rlimits; `nobody` where the interpreter is readable by it. The program can read the host's
  files.
- `unsafe-none`: rlimits and the audit hook only (no namespaces).
  The old names `unshare` and `none` are refused with a pointer to these.

The test is handed to the program as a process, never as a file in its view: stdin comes from a
file in a private control folder outside the work directory (0700, not mounted in bwrap), the
job (program mode, the functional call's arguments) is read from an inherited descriptor that
the harness closes before the program starts, and the functional result goes back through
another descriptor. Expected outputs never leave the parent.

In every mode: a fresh temporary directory is the child's cwd, HOME and TMPDIR, deleted
afterwards; `resource.setrlimit` before any model code: CPU seconds, address space (memory), file
size (also caps stdout, which goes to a file; 64 MiB by default, read back whole), process count
(`RLIMIT_NPROC`), stack (8 MiB), no core dumps; a wall-clock limit enforced by the parent; and a Python audit
hook (PEP 578) that refuses sockets, writes, directory handles and chdir outside the work dir,
starting processes and ctypes. The hook is a guard against ordinary code, not a boundary: the
namespaces are.

The program runs as LiveCodeBench's runner runs it: `LCB_PRELUDE` (its import string: `from math
import *`, `from collections import *`, ..., `sys.setrecursionlimit(50000)`) is executed first in
the program's own namespace, in stdin and functional mode alike, so `inf` or `gcd` work
unimported. A stdin program is wrapped as LiveCodeBench wraps it (`lcb_stdin_code` in the
harness): a last `if __name__ == '__main__':` block is inlined, the top-level imports stay at
module level, first, and every other top-level statement becomes the body of `wrapped_function`,
which the harness calls. So a top-level `return` ends the program, top-level names are that
function's locals (a nested `global x` or `globals()` does not find them), and `__name__` is never
`'__main__'`. `SystemExit` ends a stdin program with its output graded, whatever its status. The
main thread's stack limit is `Limits.stack_mb` (8 MiB, RLIMIT_STACK): LiveCodeBench leaves the
limit alone, so its programs get Linux's default, and setting it keeps a verdict independent of the
evaluator's own `ulimit -s`. When the program ends, the harness waits for the threads it started
and did not join (non-daemon ones, as the interpreter's own exit does) and runs its `atexit`
functions before the output is flushed.

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

from cotserve.errors import CotserveError

MODES = ("auto", "bwrap", "unsafe-unshare", "unsafe-none")
RENAMED = {"unshare": "unsafe-unshare", "none": "unsafe-none"}  # the old names, refused


class SandboxError(CotserveError):
    """The requested isolation cannot run here (or is unknown): no model-written code runs."""


@dataclass
class Limits:
    """Per-test limits. timeout_s is wall clock; the CPU limit is timeout_s + 1 (rounded up)."""

    timeout_s: float = 6.0
    memory_mb: int = 1024
    max_output_mb: int = 64  # RLIMIT_FSIZE: stdout and stderr each, read back whole
    max_processes: int = 64  # RLIMIT_NPROC (per user: counts the sandbox user's processes)
    stack_mb: int = 8  # RLIMIT_STACK of the main thread: Linux's default, what LiveCodeBench's programs get
    network_namespace: bool = True  # `unsafe-unshare` / `unsafe-none`: use `unshare -n` when available
    isolation: str = "auto"  # auto (= bwrap, else refuse) | bwrap | unsafe-unshare | unsafe-none
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


# LiveCodeBench's `import_string` (lcb_runner/evaluation/testing_util.py), which its runner puts
# before call-based and stdin programs alike.
LCB_PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\n"
    "from statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator import *\n"
    "from io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing import *\n"
    "import string\nimport re\nimport datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\n"
    "import math\nimport random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
    "import io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n"
)

# The child's entry point. It reads its job from the descriptor argv[1] (closed at once), sets the
# rlimits, runs the prelude, installs the audit hook, then runs the program; a functional result
# goes to the descriptor argv[2]. Only the standard library is used.
HARNESS = r'''
import sys, os, json, resource, io, traceback
with os.fdopen(int(sys.argv[1]), "r", encoding="utf-8") as _f:
    job = json.load(_f)
result_fd = int(sys.argv[2])
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
stack = job["stack_mb"] * 1024 * 1024
_hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
resource.setrlimit(resource.RLIMIT_STACK, (stack if _hard == resource.RLIM_INFINITY else min(stack, _hard), _hard))
import ast, atexit, threading, fractions, decimal, array  # before the guard (reading is allowed anyway)

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
def print_error():
    """The traceback's innermost 100 frames: formatting each of a RecursionError's 50,000 takes
    seconds of the program's own wall-clock limit (3.11 formats every frame it later folds into
    "[Previous line repeated ...]"), enough to turn the error into a timeout."""
    traceback.print_exc(limit=-100)

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
        for fd in (2, result_fd):  # the result descriptor is the harness's alone: children's lines
            try:                   # written to stderr after this one cannot hide it there
                os.write(fd, ("\nSANDBOX-LIMIT " + tag + "\n").encode())
            except OSError:
                pass

def finish():
    """What the interpreter's own exit does: wait for non-daemon threads, then atexit functions."""
    ok = True
    try:
        threading._shutdown()
    except BaseException as e:
        print_error()
        limit_hit(e)
        ok = False
    try:
        atexit._run_exitfuncs()
    except BaseException as e:
        limit_hit(e)
    return ok

def lcb_stdin_code(src, filename):
    """LiveCodeBench's wrapping of a stdin program: a last `if __name__ == '__main__':` block is
    inlined, the top-level imports stay at module level (in their order, before the rest), and every
    other top-level statement becomes the body of `wrapped_function`, which the harness calls."""
    tree = ast.parse(src, filename)
    body = tree.body
    if body and isinstance(body[-1], ast.If) and ast.unparse(body[-1].test) == "__name__ == '__main__'":
        body = body[:-1] + body[-1].body
    imports = [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
    fn = ast.parse("def wrapped_function():\n    pass\n").body[0]
    fn.body = [s for s in body if not isinstance(s, (ast.Import, ast.ImportFrom))] or fn.body
    tree.body = imports + [fn]
    return compile(ast.fix_missing_locations(tree), filename, "exec")

mode = job["mode"]
with open(job["program"], encoding="utf-8") as _f:
    src = _f.read()
g = {"__name__": "solution", "__builtins__": __builtins__}  # never __main__, as in LiveCodeBench
exec(compile(job["prelude"], "<prelude>", "exec"), g)
code = lcb_stdin_code(src, job["program"]) if mode == "stdin" else compile(src, job["program"], "exec")
if job["audit_hook"]:
    sys.addaudithook(guard)
status = 0
if mode == "stdin":
    try:
        exec(code, g)
        g["wrapped_function"]()
    except SystemExit:
        pass  # as in LiveCodeBench, whatever its status: the output written so far is graded
    except BaseException as e:
        print_error()
        limit_hit(e)
        status = 1
    if not finish():
        status = 1
    try:
        sys.stdout.flush()
    except BaseException as e:
        limit_hit(e)
        status = 1
    os._exit(status)
else:
    sys.stdout = io.StringIO()  # the program's own prints are not the answer
    try:
        exec(code, g)
        name = job["func_name"]
        fn = getattr(g["Solution"](), name) if "Solution" in g else g[name]
        value = fn(*job["args"])
        if not finish():
            os._exit(1)
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        payload = json.dumps({"value": value}, default=lambda o: list(o) if isinstance(o, (tuple, set)) else str(o))
    except BaseException as e:
        print_error()
        limit_hit(e)
        os._exit(1)
    data = payload.encode()
    while data:
        data = data[os.write(result_fd, data):]
    os._exit(0)
'''


NOBODY = 65534
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # what bwrap shows, read-only


def interpreter() -> str:
    """The real interpreter behind this one (a venv's python is a link to it); the harness needs
    only the standard library."""
    return os.path.realpath(sys.executable)


def python_home() -> str:
    """The folder of the Python installation (e.g. /root/.pyenv/versions/3.11.7)."""
    return os.path.realpath(sys.base_prefix)


_NOOP = (os.path.realpath(sys.executable), "-I", "-S", "-c", "")  # a probe that needs nothing on PATH


@lru_cache(maxsize=1)
def netns_prefix() -> tuple[str, ...]:
    """The `unshare` command line that gives a child its own (empty) network namespace, or ()."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    for flags in (("-n",), ("-r", "-n")):
        try:
            r = subprocess.run([exe, *flags, *_NOOP], capture_output=True, timeout=10)
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
            r = subprocess.run([exe, *flags, *_NOOP], capture_output=True, timeout=10)
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


def _under_system(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in SYSTEM)


def _searchable_parents(path: str) -> list[str]:
    """bwrap arguments that make the folders above `path` in the sandbox searchable, not listable
    (0711). The folders bwrap makes above a mount point are otherwise no more open than the host's
    (root's home is 0700), so `nobody` could not enter a Python installation under it: its
    interpreter would start, but the loader would take another libpython from /usr (another Python
    version, with its own standard library)."""
    parents = []
    p = os.path.dirname(path)
    while p not in ("/", "") and not _under_system(p):
        parents.append(p)
        p = os.path.dirname(p)
    return [arg for d in reversed(parents) for arg in ("--perms", "0711", "--dir", d)]


def bwrap_prefix(root: str) -> tuple[str, ...]:
    """The bubblewrap command line for a run whose work directory is `root`, or () without bwrap.
    Only the system folders, the Python installation and `root` are mounted (see the module doc)."""
    exe = shutil.which("bwrap")
    if not exe:
        return ()
    # every namespace but the user one (root outside: setpriv needs the real uid map)
    cmd = [exe, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session"]
    for d in SYSTEM:
        if os.path.islink(d):  # merged /usr: /bin -> usr/bin
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    cmd += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    home = python_home()
    if not _under_system(home):
        cmd += [*_searchable_parents(home), "--ro-bind", home, home]
    exe_dir = os.path.dirname(interpreter())
    if not (exe_dir == home or exe_dir.startswith(home + "/")) and not exe_dir.startswith("/usr/"):
        cmd += [*_searchable_parents(exe_dir), "--ro-bind", exe_dir, exe_dir]
    cmd += ["--bind", root, root, "--chdir", root]
    if os.geteuid() == 0:  # root outside: setpriv drops to nobody, every capability and new privileges
        priv = _setpriv(NOBODY)
        if not priv:
            return ()
        return (*cmd, "--", *priv)
    return (*cmd, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL", "--")


@lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot build a sandbox here (None: it can). Some containers forbid it."""
    if not shutil.which("bwrap"):
        return "bubblewrap (bwrap) is not installed (not on PATH)"
    root = tempfile.mkdtemp(prefix="cotserve-sbx-probe-")
    try:
        if os.geteuid() == 0:
            _give_to_nobody(root)
        prefix = bwrap_prefix(root)
        if not prefix:
            return "bubblewrap needs setpriv (util-linux) to drop root here, and setpriv is missing"
        r = subprocess.run([*prefix, interpreter(), "-I", "-S", "-c", "open('p', 'w').write('ok')"],
                           capture_output=True, timeout=30)
        if r.returncode == 0 and open(os.path.join(root, "p")).read() == "ok":
            return None
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return f"bubblewrap cannot build a sandbox here ({err[-1] if err else f'exit status {r.returncode}'})"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap cannot build a sandbox here ({exc})"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bwrap_works() -> bool:
    """bubblewrap is installed and can build a sandbox here."""
    return bwrap_problem() is None


def bwrap_version() -> str | None:
    """`bwrap --version` (e.g. `bubblewrap 0.8.0`), or None without bubblewrap."""
    exe = shutil.which("bwrap")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None


def isolation_mode(requested: str = "auto") -> str:
    """The mode a run gets. `auto` and `bwrap` are bubblewrap, or a `SandboxError` where it cannot
    run (never a silent downgrade); `unsafe-unshare` / `unsafe-none` only when asked for by name."""
    if requested in RENAMED:
        raise SandboxError(f"--sandbox {requested} was renamed --sandbox {RENAMED[requested]}: it runs model-written "
                           "code without bubblewrap's isolation, so the name says so")
    if requested not in MODES:
        raise SandboxError(f"--sandbox {requested!r}: expected {', '.join(MODES)}")
    if requested in ("auto", "bwrap"):
        problem = bwrap_problem()
        if problem is None:
            return "bwrap"
        raise SandboxError(f"{problem}, so model-written code will not run: install bubblewrap (apt-get install "
                           "bubblewrap), or pass --sandbox unsafe-unshare (PID and network namespaces only; the "
                           "code can read this machine's files) or --sandbox unsafe-none (no isolation) to run it anyway")
    if requested == "unsafe-unshare" and not pidns_prefix():
        raise SandboxError("--sandbox unsafe-unshare: unshare cannot create PID/network namespaces here "
                           "(--sandbox unsafe-none runs without any)")
    return requested


UNSAFE_WARNING = {
    "unsafe-unshare": "model-written code runs without bubblewrap: PID and network namespaces and rlimits only; "
                      "it can read every file this user can (datasets, expected outputs, keys)",
    "unsafe-none": "model-written code runs with no isolation at all (rlimits and a Python-level guard that "
                   "ordinary code can get around): it can read every file this user can",
}


def warn_if_unsafe(mode: str) -> None:
    """One warning on stderr for a weaker mode than bubblewrap."""
    if mode in UNSAFE_WARNING:
        print(f"warning: --sandbox {mode}: {UNSAFE_WARNING[mode]}", file=sys.stderr)


def describe(limits: Limits, mode: str) -> dict[str, Any]:
    """What results.json records of the sandbox: the mode used, its limits, bubblewrap's version."""
    return {"mode": mode, "requested": limits.isolation, "timeout_s": limits.timeout_s,
            "cpu_s": int(limits.timeout_s) + 1, "memory_mb": limits.memory_mb,
            "max_output_mb": limits.max_output_mb, "max_processes": limits.max_processes,
            "stack_mb": limits.stack_mb,
            "network": "none" if mode == "bwrap" or (limits.network_namespace and _netns_for(mode)) else "host",
            "bwrap_version": bwrap_version(), "lcb_prelude": True, "lcb_stdin_wrap": True}


def _netns_for(mode: str) -> bool:
    """An unsafe mode gets its own network namespace here (when `Limits.network_namespace` asks)."""
    return bool(pidns_prefix() if mode == "unsafe-unshare" else netns_prefix())


def run_program(source: str, stdin: str = "", mode: str = "stdin", func_name: str | None = None,
                args: list[Any] | None = None, limits: Limits | None = None) -> RunResult:
    """Run `source` once. mode `stdin`: feed `stdin`, capture stdout. mode `functional`: call
    `Solution().func_name(*args)` (or a top-level `func_name`) and return its value."""
    limits = limits or Limits()
    mode_used = isolation_mode(limits.isolation)
    root = os.path.realpath(tempfile.mkdtemp(prefix="cotserve-sbx-"))
    ctl = os.path.realpath(tempfile.mkdtemp(prefix="cotserve-sbx-ctl-"))  # 0700: the parent's side only
    try:
        prog = os.path.join(root, "solution.py")
        with open(prog, "w", encoding="utf-8") as f:
            f.write(source)
        job = {"root": root, "program": prog, "mode": mode, "func_name": func_name, "args": args or [],
               "cpu_s": int(limits.timeout_s) + 1, "memory_mb": limits.memory_mb,
               "max_output_mb": limits.max_output_mb, "max_processes": limits.max_processes,
               "stack_mb": limits.stack_mb, "audit_hook": limits.audit_hook, "prelude": LCB_PRELUDE}
        paths = {n: os.path.join(ctl, n) for n in ("job", "stdin", "stdout", "stderr", "result")}
        with open(paths["job"], "w", encoding="utf-8") as f:
            json.dump(job, f)
        with open(paths["stdin"], "w", encoding="utf-8") as f:
            f.write(stdin)
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        if mode_used == "bwrap":
            prefix = bwrap_prefix(root)
        elif mode_used == "unsafe-unshare":
            prefix = pidns_prefix() if limits.network_namespace else ()
            if os.geteuid() == 0 and _readable_by_all(interpreter()):
                prefix = (*prefix, *_setpriv(NOBODY))
        else:
            prefix = netns_prefix() if limits.network_namespace else ()
        if os.geteuid() == 0 and mode_used != "unsafe-none":
            _give_to_nobody(root)
        timed_out = False
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, \
                open(paths["stderr"], "wb") as ferr, open(paths["job"], "rb") as fjob, \
                open(paths["result"], "wb") as fres:
            cmd = [*prefix, interpreter(), "-I", "-S", "-c", HARNESS, str(fjob.fileno()), str(fres.fileno())]
            proc = subprocess.Popen(cmd, cwd=root, stdin=fin, stdout=fout, stderr=ferr, env=env,
                                    start_new_session=True, pass_fds=(fjob.fileno(), fres.fileno()))
            try:
                rc = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                rc = proc.wait()
        cap = limits.max_output_mb * 1024 * 1024
        stdout = _read(paths["stdout"], cap + 1)
        stderr = _read_tail(paths["stderr"], 1 << 20)
        netns = mode_used == "bwrap" or any(f in ("-n", "--net") for f in prefix)
        res = RunResult("ok", stdout, stderr, rc, extra={"netns": netns, "isolation": mode_used})
        tag = _limit_tag(_read_tail(paths["result"], 4096)) or _limit_tag(stderr)
        if timed_out:
            res.status = "timeout"
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
            res.status = "cpu_limit"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
        elif rc in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or tag == "output_limit" or \
                max(_size(paths["stdout"]), _size(paths["stderr"])) >= cap:
            res.status = "output_limit"
        elif rc != 0:
            res.status = ("refused" if "PermissionError: sandbox:" in stderr
                          else tag or ("memory" if "MemoryError" in stderr else "runtime_error"))
        elif mode == "functional":
            try:
                with open(paths["result"], encoding="utf-8") as f:
                    res.value = json.load(f)["value"]
            except (OSError, ValueError, KeyError):
                res.status = "runtime_error"
                res.stderr += "\nno result was returned"
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ctl, ignore_errors=True)


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


def _read(path: str, limit: int) -> str:
    """The first `limit` bytes of a file, as text."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def _read_tail(path: str, limit: int) -> str:
    """The last `limit` bytes of a file (stderr, or the result file that names the limit that fired)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, _size(path) - limit))
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")
