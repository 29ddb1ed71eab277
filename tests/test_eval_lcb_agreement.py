"""LiveCodeBench verdicts of the sandboxed grader agree with an independent re-execution.

The first 15 problems of the local LiveCodeBench file (9 stdin, 6 LeetCode functional), each with
a correct solution written for this test and a wrong variant of it. Every program is graded by
`grade_code` (the sandbox, every public test) and re-executed independently here: a plain
`python -c` subprocess with no sandbox and no harness, stdout compared as whitespace-separated
tokens (stdin problems) or the JSON value printed by a driver written here (functional ones).
The two verdicts must agree, and the correct solutions must pass.

Then stdin programs whose verdict depends on how LiveCodeBench's runner wraps them: each must get
the verdict that runner gave it (recorded in `WRAPPING`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cotserve.eval.graders.code import grade_code
from cotserve.eval.loaders import load_suite, parse_suites
from cotserve.eval.sandbox import Limits, bwrap_problem, pidns_prefix

# the programs here are written for this test (trusted): the strongest sandbox this machine has
TRUSTED = "auto" if bwrap_problem() is None else "unsafe-unshare" if pidns_prefix() else "unsafe-none"

SOLUTIONS: dict[str, str] = {
    "1873_A": """t = int(input())
for _ in range(t):
    s = input().strip()
    print("YES" if sum(a != b for a, b in zip(s, "abc")) <= 2 else "NO")
""",
    "1873_B": """import math
t = int(input())
for _ in range(t):
    n = int(input())
    a = sorted(map(int, input().split()))
    a[0] += 1
    print(math.prod(a))
""",
    "1873_D": """t = int(input())
for _ in range(t):
    n, k = map(int, input().split())
    s = input().strip()
    i = ops = 0
    while i < n:
        if s[i] == "B":
            ops += 1
            i += k
        else:
            i += 1
    print(ops)
""",
    "1883_B": """from collections import Counter
t = int(input())
for _ in range(t):
    n, k = map(int, input().split())
    s = input().strip()
    odd = sum(v % 2 for v in Counter(s).values())
    print("YES" if odd - k <= 1 else "NO")
""",
    "1883_C": """t = int(input())
for _ in range(t):
    n, k = map(int, input().split())
    a = list(map(int, input().split()))
    best = min((k - x % k) % k for x in a)
    if k == 4:
        even = sum(x % 2 == 0 for x in a)
        best = min(best, max(0, 2 - even))
    print(best)
""",
    "1899_A": """t = int(input())
for _ in range(t):
    n = int(input())
    print("First" if n % 3 else "Second")
""",
    "1899_B": """t = int(input())
for _ in range(t):
    n = int(input())
    a = list(map(int, input().split()))
    best = 0
    for k in range(1, n + 1):
        if n % k == 0:
            sums = [sum(a[i:i + k]) for i in range(0, n, k)]
            best = max(best, max(sums) - min(sums))
    print(best)
""",
    "1899_C": """t = int(input())
for _ in range(t):
    n = int(input())
    a = list(map(int, input().split()))
    best = cur = a[0]
    for i in range(1, n):
        if (a[i] - a[i - 1]) % 2 != 0:
            cur = max(cur + a[i], a[i])
        else:
            cur = a[i]
        best = max(best, cur)
    print(best)
""",
    "1899_D": """from collections import Counter
t = int(input())
for _ in range(t):
    n = int(input())
    c = Counter(map(int, input().split()))
    print(sum(v * (v - 1) // 2 for v in c.values()) + c[1] * c[2])
""",
    "2727": """from typing import List
class Solution:
    def countSeniors(self, details: List[str]) -> int:
        return sum(int(d[11:13]) > 60 for d in details)
""",
    "2728": """from typing import List
class Solution:
    def matrixSum(self, nums: List[List[int]]) -> int:
        rows = [sorted(r) for r in nums]
        return sum(max(col) for col in zip(*rows))
""",
    "2730": """from typing import List
class Solution:
    def maximumOr(self, nums: List[int], k: int) -> int:
        n = len(nums)
        pre, suf = [0] * (n + 1), [0] * (n + 1)
        for i in range(n):
            pre[i + 1] = pre[i] | nums[i]
        for i in range(n - 1, -1, -1):
            suf[i] = suf[i + 1] | nums[i]
        return max(pre[i] | (nums[i] << k) | suf[i + 1] for i in range(n))
""",
    "2754": """from typing import List
class Solution:
    def maxStrength(self, nums: List[int]) -> int:
        best = None
        n = len(nums)
        for mask in range(1, 1 << n):
            p = 1
            for i in range(n):
                if mask >> i & 1:
                    p *= nums[i]
            best = p if best is None else max(best, p)
        return best
""",
    "2755": """from typing import List
class Solution:
    def minExtraChar(self, s: str, dictionary: List[str]) -> int:
        words = set(dictionary)
        n = len(s)
        dp = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            dp[i] = dp[i + 1] + 1
            for j in range(i + 1, n + 1):
                if s[i:j] in words:
                    dp[i] = min(dp[i], dp[j])
        return dp[0]
""",
    "2756": """from typing import List
class Solution:
    def buyChoco(self, prices: List[int], money: int) -> int:
        a, b = sorted(prices)[:2]
        return money - a - b if a + b <= money else money
""",
}


def wrong_variant(code: str, functional: bool) -> str:
    """A plausible bug: stdin programs answer only the first test case; functional ones are off by one."""
    if functional:
        return code.replace("        return ", "        return 1 + ", 1) if "        return " in code else code + "\n"
    return code.replace("for _ in range(t):", "for _ in range(min(t, 1)):", 1)


def independent_verdict(code: str, item) -> bool:
    """Run every public test in a plain subprocess (no sandbox, no harness) and compare."""
    for t in item.meta["tests"]:
        if t["testtype"] == "functional":
            driver = (code + "\nimport json, sys\nargs = [json.loads(x) for x in sys.stdin.read().split('\\n') if x.strip()]\n"
                      f"print(json.dumps(Solution().{item.meta['func_name']}(*args)))\n")
            r = subprocess.run([sys.executable, "-c", driver], input=t["input"], capture_output=True, text=True,
                               timeout=20)
            if r.returncode != 0 or json.loads(r.stdout) != json.loads(t["output"]):
                return False
        else:
            r = subprocess.run([sys.executable, "-c", code], input=t["input"], capture_output=True, text=True,
                               timeout=20)
            if r.returncode != 0 or r.stdout.split() != t["output"].split():
                return False
    return True


@pytest.fixture(scope="module")
def items(data_dir):
    got = load_suite(parse_suites("livecodebench")[0], data_dir, "local", 15)
    assert [it.id for it in got] == list(SOLUTIONS), "the first 15 problems of the local file changed"
    return got


def test_sandbox_verdicts_agree_with_independent_re_execution(items):
    limits = Limits(timeout_s=6.0, memory_mb=1024, isolation=TRUSTED)
    rows = []
    for it in items:
        functional = it.meta["tests"][0]["testtype"] == "functional"
        for kind, code in (("correct", SOLUTIONS[it.id]), ("wrong", wrong_variant(SOLUTIONS[it.id], functional))):
            ours = grade_code(f"```python\n{code}```", it.meta, limits)
            rows.append((it.id, kind, ours.correct, independent_verdict(code, it), ours.detail))
    disagree = [r for r in rows if r[2] != r[3]]
    assert not disagree, disagree
    assert all(r[2] for r in rows if r[1] == "correct"), [r for r in rows if r[1] == "correct" and not r[2]]
    assert sum(not r[2] for r in rows if r[1] == "wrong") >= 12  # the bugs are caught by the public tests


# -- stdin programs whose verdict depends on LiveCodeBench's wrapping ------------------------------

# LiveCodeBench's runner inlines a last `if __name__ == '__main__':` block, keeps the top-level imports
# at module level and wraps every other top-level statement in a function that it calls, ignoring
# SystemExit. Each program's verdict under that runner (`run_test` of lcb_runner/evaluation/
# testing_util.py, LiveCodeBench commit 28fef95, Python 3.11) is recorded here; the sandbox must give
# the same. All but the last two got the other verdict when programs ran as a plain module.
WRAPPING = [
    ("top-level return", "n = int(input())\nif n == 0:\n    print('zero')\n    return\nprint(n)\n", "0\n", "zero\n",
     True),
    ("sys.exit(1) after the answer", "import sys\nprint(5)\nsys.exit(1)\n", "", "5\n", True),
    ("exit with a message", "print(5)\nexit('done')\nprint(6)\n", "", "5\n", True),
    ("import below its first use", "print(Fraction(1, 2))\nfrom fractions import Fraction\n", "", "1/2\n", True),
    ("global of a top-level name", "cnt = 0\ndef inc():\n    global cnt\n    cnt += 1\ninc()\nprint(cnt)\n", "",
     "1\n", False),
    ("globals() of a top-level name", "x = 5\nprint(globals().get('x'))\n", "", "5\n", False),
    ("__main__ guard not last", "def main():\n    print(7)\nif __name__ == '__main__':\n    main()\nx = 1\n", "",
     "7\n", False),
    ("__main__ guard reversed", "def main():\n    print(7)\nif '__main__' == __name__:\n    main()\n", "", "7\n",
     False),
    ("star import inside try", "try:\n    from math import *\nexcept ImportError:\n    pass\nprint(1)\n", "", "1\n",
     False),
    ("last __main__ guard", 'def main():\n    print(int(input()) * 2)\nif __name__ == "__main__":\n    main()\n',
     "4\n", "8\n", True),
    ("top-level names in a class body", "K = 3\nclass A:\n    v = K * 2\nprint(A.v)\n", "", "6\n", True),
]


@pytest.mark.parametrize("name,code,stdin,expected,lcb_passes", WRAPPING, ids=[w[0] for w in WRAPPING])
def test_wrapped_stdin_programs_get_livecodebench_verdicts(name, code, stdin, expected, lcb_passes):
    meta = {"tests": [{"input": stdin, "output": expected, "testtype": "stdin"}]}
    g = grade_code(f"```python\n{code}```", meta, Limits(timeout_s=6.0, isolation=TRUSTED))
    assert g.correct == lcb_passes, g.detail
