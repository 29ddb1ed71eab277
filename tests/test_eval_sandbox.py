"""The code sandbox and the LiveCodeBench grader on programs that pass, fail, loop forever (killed
by the time limit), try to write outside their temp dir, open a socket or start a process
(refused), and exhaust memory. Every program really runs, in a real child process."""

from __future__ import annotations

import socket

import pytest

from cotserve.eval.graders.code import grade_code, run_tests
from cotserve.eval.sandbox import Limits, netns_prefix, run_program

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
