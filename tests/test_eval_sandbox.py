"""The code sandbox and the LiveCodeBench grader on programs that pass, fail, loop forever (killed
by the time limit), try to write outside their temp dir, open a socket or start a process
(refused), and exhaust memory. Every program really runs, in a real child process."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cotserve.eval.graders.code import grade_code, run_tests
from cotserve.eval.sandbox import Limits, isolation_mode, netns_prefix, run_program

FAST = Limits(timeout_s=2.0, memory_mb=512)

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
    r = run_program("while True:\n    pass\n", limits=Limits(timeout_s=1.0))
    assert r.status == "timeout"
    ok, detail = run_tests("import time\nwhile True: time.sleep(0.01)\n", STDIN_META, Limits(timeout_s=1.0))
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
    r = run_program(code, limits=Limits(timeout_s=3.0, network_namespace=use_netns))
    assert r.status == "refused" and "connected" not in r.stdout


def test_network_namespace_is_used_when_available():
    r = run_program("print('x')", limits=FAST)
    assert r.extra["netns"] == bool(netns_prefix())


def test_starting_processes_is_refused():
    for code in ("import os\nos.system('echo hi')\n", "import subprocess\nsubprocess.run(['true'])\n",
                 "import os\nos.fork()\n"):
        r = run_program(code, limits=FAST)
        assert r.status == "refused", (code, r)


def test_memory_limit():
    r = run_program("x = bytearray(900 * 1024 * 1024)\nprint(len(x))\n", limits=Limits(timeout_s=5, memory_mb=256))
    assert r.status == "memory"


def test_no_code_block_fails():
    g = grade_code("I would use a hash map.", FUNC_META, FAST)
    assert not g.correct and g.extracted is None


# -- hostile code: the escapes a sandbox must refuse ---------------------------------------------
# Each escape runs twice where bubblewrap works: with the audit hook (refused at the first step)
# and without it (`audit_hook=False`), so the namespaces, the unprivileged user and the rlimits
# are shown to hold on their own. `unshare` (the fallback) is tested with the hook, which it needs.

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
    if isolation_mode_or_none("unshare"):
        modes.append(("unshare", True))
    return modes


def isolation_mode_or_none(mode: str) -> str | None:
    try:
        return isolation_mode(mode)
    except RuntimeError:
        return None


HOSTILE = pytest.mark.parametrize("mode,hook", _modes() or [pytest.param("none", True, marks=pytest.mark.skip(
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


@pytest.mark.skipif(not isolation_mode_or_none("bwrap") and not isolation_mode_or_none("unshare"),
                    reason="no PID namespace here")
@pytest.mark.parametrize("mode", [m for m in ("bwrap", "unshare") if isolation_mode_or_none(m)])
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


@pytest.mark.skipif(not isolation_mode_or_none("bwrap"), reason="bubblewrap cannot run here")
def test_bwrap_view_user_network_and_process_limit():
    """Without the audit hook: the program is `nobody`, sees none of /work (datasets, code) or the
    host's /tmp, has no network, and a fork bomb stops at RLIMIT_NPROC with its own label."""
    probe = ("import os, socket\nprint(os.getuid(), os.listdir('/work'), os.listdir('/tmp') == [os.path.basename(os.getcwd())])\n"
             "try:\n    socket.create_connection(('127.0.0.1', 6379), timeout=2)\n    print('connected')\n"
             "except OSError as e:\n    print('no network', e.errno)\n")
    r = run_program(probe, limits=_limits("bwrap", False))
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines()[0] == "65534 [] True" and "no network" in r.stdout
    bomb = FORK_EXEC + "for i in range(400):\n    spawn('sleep 5')\n"
    r = run_program(bomb, limits=_limits("bwrap", False, max_processes=16))
    assert r.status == "process_limit", (r.status, r.stderr[-300:])


@pytest.mark.parametrize("code,status", [
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "output_limit"),
    ("x = bytearray(900 * 1024 * 1024)\n", "memory"),
    ("while True:\n    pass\n", "timeout"),
    ("raise ValueError('plain bug')\n", "runtime_error"),
])
def test_limits_are_labelled_by_which_fired(code, status):
    r = run_program(code, limits=Limits(timeout_s=2.0, memory_mb=256, max_output_mb=1))
    assert r.status == status, (r.status, r.stderr[-300:])
