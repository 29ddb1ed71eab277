"""The code sandbox and the LiveCodeBench grader on programs that pass, fail, loop forever (killed
by the time limit), try to write outside their temp dir, open a socket or start a process
(refused), and exhaust memory. Every program really runs, in a real child process."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cotserve.eval.graders.code import grade_code, run_tests
from cotserve.eval.sandbox import (
    Limits,
    SandboxError,
    bwrap_problem,
    isolation_mode,
    netns_prefix,
    pidns_prefix,
    run_program,
)

# The programs in this file are written by the tests (trusted). Where bubblewrap cannot run they use
# the strongest mode left, named, so the limits are still tested; bubblewrap's own properties skip.
TRUSTED = "auto" if bwrap_problem() is None else "unsafe-unshare" if pidns_prefix() else "unsafe-none"
NEEDS_BWRAP = pytest.mark.skipif(bwrap_problem() is not None, reason=f"{bwrap_problem()}: the bubblewrap sandbox "
                                 "cannot be tested here")
FAST = Limits(timeout_s=2.0, memory_mb=512, isolation=TRUSTED)

STDIN_META = {"tests": [{"input": "3\n1 2 3\n", "output": "6\n", "testtype": "stdin"},
                        {"input": "2\n10 -4\n", "output": "6", "testtype": "stdin"}]}
FUNC_META = {"func_name": "twoSum", "starter_code": "class Solution:\n    def twoSum(self, nums, target):\n",
             "tests": [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"},
                       {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"}]}

SUM_OK = "n = int(input())\nprint(sum(map(int, input().split())))\n"
SUM_WRONG = "n = int(input())\nprint(max(map(int, input().split())))\n"
TWO_SUM_OK = """class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
"""


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\n"


def test_stdin_program_passes_and_wrong_one_fails():
    assert grade_code(fenced(SUM_OK), STDIN_META, FAST).correct
    g = grade_code(fenced(SUM_WRONG), STDIN_META, FAST)
    assert not g.correct and "test 0: wrong answer" in g.detail


def test_functional_leetcode_style():
    g = grade_code(fenced(TWO_SUM_OK), FUNC_META, FAST)
    assert g.correct, g.detail
    wrong = TWO_SUM_OK.replace("[seen[target - x], i]", "[i, seen[target - x]]")
    assert not grade_code(fenced(wrong), FUNC_META, FAST).correct
    crash = "class Solution:\n    def twoSum(self, nums, target):\n        return nums[99]\n"
    g = grade_code(fenced(crash), FUNC_META, FAST)
    assert not g.correct and "runtime_error" in g.detail and "IndexError" in g.detail


def test_program_printing_in_functional_mode_still_returns_its_value():
    noisy = TWO_SUM_OK.replace("        seen = {}", "        print('debug'); seen = {}")
    assert grade_code(fenced(noisy), FUNC_META, FAST).correct


def test_infinite_loop_is_killed_by_the_time_limit():
    r = run_program("while True:\n    pass\n", limits=Limits(timeout_s=1.0, isolation=TRUSTED))
    assert r.status == "timeout"
    ok, detail = run_tests("import time\nwhile True: time.sleep(0.01)\n", STDIN_META, Limits(timeout_s=1.0, isolation=TRUSTED))
    assert not ok and "timeout" in detail


def test_write_outside_the_temp_dir_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run_program(f"open({str(target)!r}, 'w').write('x')\n", limits=FAST)
    assert r.status == "refused" and "write outside the sandbox" in r.stderr
    assert not target.exists()
    r = run_program(f"import os\nos.remove({str(tmp_path)!r} + '/../x')\n", limits=FAST)
    assert r.status == "refused"
    r = run_program("import os\nos.rename('a', '/tmp/cotserve-sbx-escape')\n", limits=FAST)
    assert r.status == "refused"


def test_writes_inside_the_temp_dir_are_allowed():
    r = run_program("open('scratch.txt', 'w').write('hi')\nprint(open('scratch.txt').read())\n", limits=FAST)
    assert r.status == "ok" and r.stdout.strip() == "hi"


@pytest.mark.parametrize("use_netns", [True, False])
def test_network_is_refused(use_netns):
    """With and without the network namespace: the audit hook alone also refuses sockets. The
    target is the real Redis the test suite uses, which the parent process can reach."""
    with socket.create_connection(("127.0.0.1", 6379), timeout=2):
        pass  # reachable from here
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 6379), timeout=2)\nprint('connected')\n"
    mode = TRUSTED if use_netns else "unsafe-none"  # without any namespace, the hook alone
    r = run_program(code, limits=Limits(timeout_s=3.0, network_namespace=use_netns, isolation=mode))
    assert r.status == "refused" and "connected" not in r.stdout


def test_network_namespace_is_used_when_available():
    r = run_program("print('x')", limits=FAST)
    assert r.extra["netns"] == (r.extra["isolation"] == "bwrap" or bool(netns_prefix()))


def test_starting_processes_is_refused():
    for code in ("import os\nos.system('echo hi')\n", "import subprocess\nsubprocess.run(['true'])\n",
                 "import os\nos.fork()\n"):
        r = run_program(code, limits=FAST)
        assert r.status == "refused", (code, r)


def test_memory_limit():
    r = run_program("x = bytearray(900 * 1024 * 1024)\nprint(len(x))\n", limits=Limits(timeout_s=5, memory_mb=256, isolation=TRUSTED))
    assert r.status == "memory"


def test_no_code_block_fails():
    g = grade_code("I would use a hash map.", FUNC_META, FAST)
    assert not g.correct and g.extracted is None


# -- hostile code: the escapes a sandbox must refuse ---------------------------------------------
# Each escape runs twice where bubblewrap works: with the audit hook (refused at the first step)
# and without it (`audit_hook=False`), so the namespaces, the unprivileged user and the rlimits
# are shown to hold on their own. `unsafe-unshare` is tested with the hook, which it needs.

FORK_EXEC = """import os, _posixsubprocess
def spawn(cmd, setsid=False):
    r, w = os.pipe()
    return _posixsubprocess.fork_exec([b"/bin/sh", b"-c", cmd.encode()], [b"/bin/sh"], True, (w,), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, setsid, -1, None, None, None, -1, None, False)
"""


def _modes() -> list[tuple[str, bool]]:
    modes = []
    if isolation_mode_or_none("bwrap"):
        modes += [("bwrap", True), ("bwrap", False)]
    if isolation_mode_or_none("unsafe-unshare"):
        modes.append(("unsafe-unshare", True))
    return modes


def isolation_mode_or_none(mode: str) -> str | None:
    try:
        return isolation_mode(mode)
    except SandboxError:
        return None


HOSTILE = pytest.mark.parametrize("mode,hook", _modes() or [pytest.param("unsafe-none", True, marks=pytest.mark.skip(
    reason="neither bubblewrap nor unshare can build namespaces on this machine"))])


def _limits(mode: str, hook: bool, **kw) -> Limits:
    return Limits(timeout_s=kw.pop("timeout_s", 3.0), memory_mb=512, isolation=mode, audit_hook=hook, **kw)


@HOSTILE
def test_chdir_elsewhere_then_write_does_not_reach_the_host(mode, hook):
    """chdir to the work dir's parent (the host's /tmp outside bwrap) and write there."""
    import time

    name = f"cotserve-escaped-chdir-{time.time_ns()}.txt"
    code = f"import os\nos.chdir('..')\nopen({name!r}, 'w').write('x')\nprint(os.getcwd())\n"
    r = run_program(code, limits=_limits(mode, hook))
    assert not Path("/tmp", name).exists()
    if hook:
        assert r.status == "refused" and "chdir outside" in r.stderr
    else:  # bwrap: the sandbox's own empty /tmp belongs to root; only the work dir is writable
        assert r.status == "runtime_error" and "PermissionError" in r.stderr


@HOSTILE
def test_write_through_a_directory_fd_does_not_reach_the_host(mode, hook):
    import time

    name = f"cotserve-escaped-dirfd-{time.time_ns()}.txt"
    code = (f"import os\nd = os.open('..', os.O_RDONLY)\n"
            f"fd = os.open({name!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)\nos.write(fd, b'x')\n")
    r = run_program(code, limits=_limits(mode, hook))
    assert not Path("/tmp", name).exists()
    if hook:
        assert r.status == "refused" and "directory handle outside" in r.stderr
    for etc in ("/etc", "/usr/lib"):  # the rest of the file system: read-only, whatever the hook
        code = f"import os\nd = os.open({etc!r}, os.O_RDONLY)\nos.open('cotserve-x', os.O_WRONLY | os.O_CREAT, dir_fd=d)\n"
        r = run_program(code, limits=_limits(mode, hook))
        assert r.status in ("refused", "runtime_error") and not Path(etc, "cotserve-x").exists()


@HOSTILE
def test_fork_exec_without_an_audit_event(tmp_path, mode, hook):
    target = tmp_path / "escaped-fork-exec.txt"
    code = FORK_EXEC + f"spawn('echo x > {target}')\nimport time\ntime.sleep(0.5)\n"
    r = run_program(code, limits=_limits(mode, hook))
    assert not target.exists()
    if hook:
        assert r.status == "refused" and "import of _posixsubprocess" in r.stderr


def _alive(marker: str) -> list[int]:
    import os

    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(not isolation_mode_or_none("bwrap") and not isolation_mode_or_none("unsafe-unshare"),
                    reason="no PID namespace here")
@pytest.mark.parametrize("mode", [m for m in ("bwrap", "unsafe-unshare") if isolation_mode_or_none(m)])
def test_kill_reaches_setsid_descendants(mode):
    """A setsid shell (its own session and process group) must die with the run that started it."""
    import time

    marker = f"98{time.time_ns() % 10**6}.5"
    code = FORK_EXEC + f"spawn('sleep {marker}', setsid=True)\nspawn('setsid sleep {marker}')\nwhile True:\n    pass\n"
    r = run_program(code, limits=_limits(mode, False, timeout_s=2.0))
    assert r.status == "timeout"
    deadline = time.time() + 5
    while _alive(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert _alive(marker) == []


@NEEDS_BWRAP
def test_bwrap_view_user_network_and_process_limit():
    """Without the audit hook: the program is `nobody`, sees no /work (datasets, code) nor the
    host's /tmp, has no network, and a fork bomb stops at RLIMIT_NPROC with its own label."""
    probe = ("import os, socket\nprint(os.getuid(), os.path.exists('/work'), os.listdir('/tmp') == [os.path.basename(os.getcwd())])\n"
             "try:\n    socket.create_connection(('127.0.0.1', 6379), timeout=2)\n    print('connected')\n"
             "except OSError as e:\n    print('no network', e.errno)\n")
    r = run_program(probe, limits=_limits("bwrap", False))
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines()[0] == "65534 False True" and "no network" in r.stdout
    bomb = FORK_EXEC + "for i in range(400):\n    spawn('sleep 5')\n"
    r = run_program(bomb, limits=_limits("bwrap", False, max_processes=16))
    assert r.status == "process_limit", (r.status, r.stderr[-300:])


@NEEDS_BWRAP
def test_limit_label_survives_stderr_written_after_it():
    """The limit's label does not depend on stderr's last lines: here a thread the program started
    writes to stderr after the fork limit fired (as the shells that did start write "Cannot fork"),
    and the run is still labelled by the limit, not as a runtime error."""
    late = ("import sys, threading, time\n"
            "def late():\n    time.sleep(0.5)\n    for _ in range(8):\n        print('late line', file=sys.stderr)\n"
            "threading.Thread(target=late).start()\n")
    bomb = FORK_EXEC + late + "for i in range(400):\n    spawn('sleep 5')\n"
    r = run_program(bomb, limits=_limits("bwrap", False, max_processes=16))
    assert r.stderr.rstrip().endswith("late line"), r.stderr[-300:]
    assert r.status == "process_limit", (r.status, r.stderr[-300:])


@NEEDS_BWRAP
def test_bwrap_program_runs_on_the_evaluators_python():
    """The program runs on this interpreter and its own standard library, also where the Python
    installation sits below a folder `nobody` cannot enter on the host (root's 0700 home): not on
    another libpython and standard library that the system folders happen to hold."""
    import os

    probe = "import os, sys\nprint(sys.version)\nprint(os.path.realpath(os.__file__))\n"
    r = run_program(probe, limits=_limits("bwrap", False))
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines() == [sys.version, os.path.realpath(os.__file__)]


@pytest.mark.parametrize("code,status", [
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "output_limit"),
    ("x = bytearray(900 * 1024 * 1024)\n", "memory"),
    ("while True:\n    pass\n", "timeout"),
    ("raise ValueError('plain bug')\n", "runtime_error"),
])
def test_limits_are_labelled_by_which_fired(code, status):
    r = run_program(code, limits=Limits(timeout_s=2.0, memory_mb=256, max_output_mb=1, isolation=TRUSTED))
    assert r.status == status, (r.status, r.stderr[-300:])


# -- as LiveCodeBench runs programs ----------------------------------------------------------------

def test_lcb_prelude_names_work_unimported_in_both_modes():
    """`inf`, `gcd`, `deque`, `heappush`, `accumulate`, `List` come from LiveCodeBench's prelude."""
    stdin_prog = ("n = int(input())\nq = deque([n])\nh = []\nheappush(h, gcd(n, 12))\n"
                  "print(h[0], list(accumulate([1, 2, 3]))[-1], min(inf, n), q[0])\n")
    g = grade_code(fenced(stdin_prog), {"tests": [{"input": "8\n", "output": "4 6 8 8\n", "testtype": "stdin"}]},
                   FAST)
    assert g.correct, g.detail
    func = ("class Solution:\n    def f(self, a: List[int]) -> int:\n"
            "        best = -inf\n        for x in a:\n            best = max(best, gcd(x, 12))\n        return best\n")
    meta = {"func_name": "f", "tests": [{"input": "[8, 9, 30]", "output": "6", "testtype": "functional"}]}
    g = grade_code(fenced(func), meta, FAST)
    assert g.correct, g.detail


def test_prelude_matches_livecodebench_import_string():
    from cotserve.eval.sandbox import LCB_PRELUDE

    lines = LCB_PRELUDE.strip().splitlines()
    assert lines[0] == "from string import *" and lines[-1] == "sys.setrecursionlimit(50000)"
    stars = [ln.split()[1] for ln in lines if ln.startswith("from ")]
    assert stars == ["string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                     "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing"]
    plain = [ln.split()[1] for ln in lines if ln.startswith("import ")]
    assert plain == stars[:16] and "from __future__" not in LCB_PRELUDE
    r = run_program("import sys\nprint(sys.getrecursionlimit())\nfrom __future__ import annotations\n", limits=FAST)
    assert r.status == "runtime_error"  # a __future__ import must come first in the program itself
    r = run_program("from __future__ import annotations\nimport sys\nprint(sys.getrecursionlimit())\n", limits=FAST)
    assert r.status == "ok" and r.stdout.strip() == "50000", r.stderr


# C-level recursion (through lru_cache's wrapper) uses the main thread's stack: about 2,000 levels
# fit in 1 MiB, about 17,000 in 8 MiB, 100,000 need some 50 MiB.
LRU_DEPTH = ("import sys\nfrom functools import lru_cache\nsys.setrecursionlimit({limit})\n@lru_cache(None)\n"
             "def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nprint(f({depth}))\n")
_, STACK_HARD = resource.getrlimit(resource.RLIMIT_STACK)


def _run_under_stack(soft: int, source: str) -> dict:
    """`run_program(source)` called by an evaluator whose own soft stack limit is `soft`."""
    script = ("import json, sys\nfrom cotserve.eval.sandbox import Limits, run_program\n"
              f"r = run_program(sys.stdin.read(), limits=Limits(timeout_s=6.0, isolation={TRUSTED!r}))\n"
              "print(json.dumps({'status': r.status, 'stdout': r.stdout}))\n")
    r = subprocess.run([sys.executable, "-c", script], input=source, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_STACK, (soft, STACK_HARD)))
    assert r.returncode == 0, r.stderr[-500:]
    return json.loads(r.stdout)


@pytest.mark.skipif(STACK_HARD != resource.RLIM_INFINITY, reason="the hard stack limit is not unlimited here")
@pytest.mark.parametrize("inherited", [1 << 20, resource.RLIM_INFINITY], ids=["1MiB", "unlimited"])
def test_programs_get_an_8_mib_stack_whatever_the_evaluator_has(inherited):
    """LiveCodeBench leaves the stack limit alone, so its programs get Linux's default 8 MiB; here the
    harness sets 8 MiB (`Limits.stack_mb`), so a verdict does not depend on the shell's `ulimit -s`."""
    fits = _run_under_stack(inherited, LRU_DEPTH.format(limit=50000, depth=8000))
    assert fits == {"status": "ok", "stdout": "8000\n"}, fits  # 1 MiB inherited: a crash without the limit
    too_deep = _run_under_stack(inherited, LRU_DEPTH.format(limit=10**6, depth=100_000))
    assert too_deep["status"] == "runtime_error" and not too_deep["stdout"]  # unlimited: it would pass
    seen = _run_under_stack(inherited, "import resource\nprint(resource.getrlimit(resource.RLIMIT_STACK)[0])\n")
    assert seen["stdout"].strip() == str(8 << 20)


def test_deep_recursion_within_livecodebench_limit_passes():
    """The prelude's recursion limit (50000) holds in a stdin program, wrapped in a function as in
    LiveCodeBench: 45,000 Python frames without any setrecursionlimit of the program's own."""
    code = "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\nprint(depth(int(input())))\n"
    meta = {"tests": [{"input": "45000\n", "output": "45000\n", "testtype": "stdin"}]}
    assert grade_code(fenced(code), meta, FAST).correct
    meta = {"tests": [{"input": "60000\n", "output": "60000\n", "testtype": "stdin"}]}
    g = grade_code(fenced(code), meta, FAST)
    assert not g.correct and "RecursionError" in g.detail, g.detail


def test_stdout_larger_than_a_mebibyte_is_kept_whole():
    n = 400_000  # 3.6 MB of output
    code = f"import sys\nsys.stdout.write(''.join('%08d\\n' % i for i in range({n})))\n"
    expected = "".join(f"{i:08d}\n" for i in range(n))
    r = run_program(code, limits=Limits(timeout_s=10.0, isolation=TRUSTED))
    assert r.status == "ok" and len(r.stdout) == len(expected) and r.stdout == expected
    ok, detail = run_tests(code, {"tests": [{"input": "", "output": expected, "testtype": "stdin"}]},
                           Limits(timeout_s=10.0, isolation=TRUSTED))
    assert ok, detail


def test_threads_not_joined_finish_writing_before_exit():
    code = ("import threading, time\n"
            "def late():\n    time.sleep(0.4)\n    print('written by the thread')\n"
            "threading.Thread(target=late).start()\nprint('main done')\n")
    r = run_program(code, limits=FAST)
    assert r.status == "ok" and r.stdout.splitlines() == ["main done", "written by the thread"], r
    daemon = code.replace("target=late)", "target=late, daemon=True)")  # a daemon thread dies with the program
    assert run_program(daemon, limits=FAST).stdout.splitlines() == ["main done"]
    forever = "import threading\nthreading.Thread(target=lambda: threading.Event().wait()).start()\n"
    assert run_program(forever, limits=Limits(timeout_s=1.0, isolation=TRUSTED)).status == "timeout"


# -- what the program can see ---------------------------------------------------------------------

CHEAT = """import os
target = ''.join(reversed({token!r}))
for top in {roots!r}:
    for dirpath, dirs, files in os.walk(top):
        for name in files:
            try:
                with open(os.path.join(dirpath, name), errors='replace') as f:
                    if target in f.read():
                        print(target)
                        raise SystemExit
            except OSError:
                pass
print('not found')
"""


def _cheat_case(tmp_path):
    """A made-up data file holding the expected output, and a program that looks for it."""
    import uuid

    token = f"expected-{uuid.uuid4().hex}"
    data = tmp_path / "data"
    data.mkdir()
    (data / "suite.jsonl").write_text(json.dumps({"output": token}) + "\n")
    meta = {"tests": [{"input": "1\n", "output": token, "testtype": "stdin"}]}
    program = CHEAT.format(token=token[::-1], roots=[str(tmp_path), "/tmp", "/work"])
    return meta, program


@NEEDS_BWRAP
def test_bwrap_program_cannot_read_the_expected_outputs(tmp_path):
    """The data file is on this machine, readable by the test; inside bubblewrap the program finds no
    copy of the expected output anywhere it can look, and its work directory holds only itself."""
    meta, program = _cheat_case(tmp_path)
    g = grade_code(fenced(program), meta, Limits(timeout_s=10.0, isolation="bwrap"))
    assert not g.correct and g.detail == "test 0: wrong answer", g.detail
    probe = ("import os, sys\nprint(sorted(os.listdir('.')), sorted(os.listdir('/tmp')) == [os.path.basename(os.getcwd())], "
             "sys.stdin.read().strip())\n")
    r = run_program(probe, stdin="its own input", limits=Limits(timeout_s=5.0, isolation="bwrap", audit_hook=False))
    assert r.status == "ok" and r.stdout.strip() == "['solution.py'] True its own input", r.stderr
    top = run_program("import os\nprint(sorted(os.listdir('/')))\n", limits=Limits(isolation="bwrap"))
    assert set(eval(top.stdout)) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc",
                                     "tmp", "root", "home", "opt"}, top.stdout  # root/home/opt: the Python home only


def test_without_isolation_the_same_program_reads_them(tmp_path):
    """The check above is real: with no isolation the program finds the data file and passes."""
    meta, program = _cheat_case(tmp_path)
    g = grade_code(fenced(program), meta, Limits(timeout_s=10.0, isolation="unsafe-none"))
    assert g.correct, g.detail


# -- bubblewrap or a named unsafe mode --------------------------------------------------------------

def test_recorded_network_matches_the_mode():
    from cotserve.eval.sandbox import describe

    assert describe(Limits(isolation="unsafe-none", network_namespace=False), "unsafe-none")["network"] == "host"
    assert describe(Limits(), "bwrap")["network"] == "none"
    assert describe(Limits(), "unsafe-none")["network"] == ("none" if netns_prefix() else "host")


def test_old_mode_names_and_unknown_ones_are_refused():
    with pytest.raises(SandboxError, match="renamed --sandbox unsafe-unshare"):
        isolation_mode("unshare")
    with pytest.raises(SandboxError, match="renamed --sandbox unsafe-none"):
        isolation_mode("none")
    with pytest.raises(SandboxError, match="expected auto, bwrap, unsafe-unshare, unsafe-none"):
        isolation_mode("docker")


def _path_without_bwrap(tmp_path) -> str:
    """A PATH holding this machine's unshare and setpriv, and no bwrap."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def _code_suite(tmp_path) -> Path:
    path = tmp_path / "code.jsonl"
    path.write_text('{"id": "sum", "question": "Print the sum of the numbers on stdin.", '
                    '"tests": [{"input": "1 2 3", "output": "6", "testtype": "stdin"}]}\n')
    return path


def test_cli_without_bubblewrap_refuses_code_suites(tmp_path):
    """bwrap removed from PATH: `--sandbox auto` (the default) refuses in one line naming the unsafe
    flags, before any model loads (the model named here does not exist)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": _path_without_bwrap(tmp_path)}
    base = [sys.executable, "-m", "cotserve.cli", "eval", "--suite", f"custom:{_code_suite(tmp_path)}:question:answer:code",
            "--out", str(tmp_path / "out"), "--model", str(tmp_path / "no-such-model"), "--no-progress"]
    for extra in ([], ["--sandbox", "auto"], ["--sandbox", "bwrap"]):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and r.stderr.startswith("error:"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert "bubblewrap (bwrap) is not installed" in r.stderr and "--sandbox unsafe-unshare" in r.stderr
    r = subprocess.run(base + ["--sandbox", "unshare"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "renamed --sandbox unsafe-unshare" in r.stderr
    r = subprocess.run(base + ["--sandbox", "unsafe-none"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "no-such-model" in r.stderr  # past the sandbox: the model is what fails now


RUN_CANNED = """
import json, sys
from pathlib import Path
from cotserve.eval.backends import Output
from cotserve.eval.loaders import parse_suites
from cotserve.eval.runner import EvalConfig, parse_variants, run_eval
from cotserve.eval.sandbox import Limits

REPLY = "Here:\\n```python\\nprint(sum(map(int, input().split())))\\n```\\n"


class Canned:
    '''Replies with one fixed program: the sandbox, not a model, is under test.'''

    def describe(self):
        return {"mode": "canned", "model": "canned"}

    def check(self, policy, options):
        pass

    def drain(self):
        return []

    def run(self, jobs):
        for j in jobs:
            yield Output(j, REPLY, REPLY, finish_reason="stop", completion_tokens=12, t_start=1.0, t_end=2.0)


suite, out, mode = sys.argv[1:4]
cfg = EvalConfig(suites=parse_suites(suite), variants=parse_variants("dense"), out=Path(out), data_dir=None,
                 progress=False, redundancy_model=None, code_limits=Limits(timeout_s=5.0, isolation=mode))
res = run_eval(cfg, Canned())
print(json.dumps([res["runs"][0]["correct"], res["meta"]["sandbox"]]))
"""


def _run_canned(tmp_path, mode: str, env: dict | None = None):
    import subprocess
    import sys

    out = tmp_path / f"out-{mode}"
    suite = f"custom:{_code_suite(tmp_path)}:question:answer:code"
    return out, subprocess.run([sys.executable, "-c", RUN_CANNED, suite, str(out), mode], capture_output=True,
                               text=True, timeout=300, env=env)


def test_runner_without_bubblewrap_runs_only_when_named_unsafe_and_warns(tmp_path):
    import os

    env = {**os.environ, "PATH": _path_without_bwrap(tmp_path)}
    out, r = _run_canned(tmp_path, "auto", env)
    assert r.returncode != 0 and "SandboxError" in r.stderr and "--sandbox unsafe-unshare" in r.stderr
    assert not (out / "predictions.jsonl").exists() or not (out / "predictions.jsonl").read_text()  # nothing ran
    mode = "unsafe-unshare" if pidns_prefix() else "unsafe-none"
    out, r = _run_canned(tmp_path, mode, env)
    assert r.returncode == 0, r.stderr
    assert f"warning: --sandbox {mode}:" in r.stderr and "can read every file" in r.stderr
    correct, sandbox = json.loads(r.stdout.strip().splitlines()[-1])
    assert correct == 1  # the program ran, unisolated, and passed
    assert sandbox["mode"] == mode and sandbox["bwrap_version"] is None
    assert (sandbox["timeout_s"], sandbox["memory_mb"], sandbox["max_output_mb"]) == (5.0, 1024, 64)
    saved = json.loads((out / "results.json").read_text())["meta"]["sandbox"]
    assert saved == sandbox
    report = (out / "report.md").read_text()
    assert f"code sandbox: {mode};" in report and "UNSAFE" in report


@NEEDS_BWRAP
def test_runner_records_bubblewrap_and_its_version(tmp_path):
    import shutil
    import subprocess

    out, r = _run_canned(tmp_path, "auto")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    correct, sandbox = json.loads(r.stdout.strip().splitlines()[-1])
    version = subprocess.run([shutil.which("bwrap"), "--version"], capture_output=True, text=True).stdout.strip()
    assert correct == 1 and sandbox["mode"] == "bwrap" and sandbox["bwrap_version"] == version
    assert sandbox["network"] == "none" and sandbox["stack_mb"] == 8 and sandbox["lcb_stdin_wrap"] is True
    report = (out / "report.md").read_text()
    assert f"code sandbox: bwrap ({version})" in report and "UNSAFE" not in report
    assert "64 processes, 8 MiB stack, network none; LiveCodeBench's import prelude and stdin wrapping" in report
