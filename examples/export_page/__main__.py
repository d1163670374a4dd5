"""``python -m examples.export_page``: a private Redis, a Dramatiq worker and the export page, in one command.

Open the page, click Export, then SIGKILL the worker mid-export (the
command to do so is printed): the next click is answered "an export is
running" with a countdown, and the button comes back by itself once the
dead worker's lease has expired. This launcher starts a fresh worker
whenever the last one exits, so the next export runs to completion.
Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """One ``dramatiq examples.web_tasks`` process group at a time, started again whenever it exits."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        """Start a worker process (one process, two threads) in a process group of its own."""
        argv = [sys.executable, "-m", "dramatiq", "examples.web_tasks", "--processes", "1", "--threads", "2"]
        # A session of its own: Ctrl-C in the terminal reaches this launcher only, which stops it cleanly.
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, start_new_session=True)
        print(f"worker started: SIGKILL it mid-export with  kill -9 -- -{self.proc.pid}", flush=True)
        return self.proc

    def stop(self) -> None:
        """SIGTERM to the group's leader (dramatiq passes it on), then SIGKILL to what is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _exit_on(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run Redis (unless ``--redis-url``), a worker and the page until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m examples.export_page", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="the page's port on 127.0.0.1 (default 8000)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    parser.add_argument(
        "--lock-ttl-ms",
        type=int,
        default=10_000,
        help="the export lease's TTL (default 10 000: a dead worker's lease expires within 10 s)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on)  # a SIGTERM stops the worker and Redis too, as Ctrl-C does

    with contextlib.ExitStack() as cleanup:
        url = args.redis_url
        if url is None:
            from dramatiq_leases.embedded import EmbeddedRedis

            url = cleanup.enter_context(EmbeddedRedis()).url()
        env = {
            **os.environ,
            "REDIS_URL": url,
            "EXPORT_LOCK_TTL_MS": str(args.lock_ttl_ms),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        os.environ.update(REDIS_URL=url, EXPORT_LOCK_TTL_MS=str(args.lock_ttl_ms))  # read by web_tasks on import
        from werkzeug.serving import make_server

        from examples.export_page.app import app

        server = make_server("127.0.0.1", args.port, app, threaded=True)
        threading.Thread(target=server.serve_forever, name="export-page", daemon=True).start()
        cleanup.callback(server.shutdown)
        worker = Worker(env)
        cleanup.callback(worker.stop)
        print(f"export page: http://127.0.0.1:{args.port}/  (Redis {url}, lock TTL {args.lock_ttl_ms} ms)", flush=True)
        try:
            while True:
                started = time.monotonic()
                code = worker.start().wait()  # blocks until the worker exits
                if code >= 0 and time.monotonic() - started < 5:  # not killed, it could not start: say so, no loop
                    print(f"the worker exited ({code}) as it started; see its output above", file=sys.stderr)
                    return 1
                print(f"worker exited ({code}); its lease, if any, ends by its TTL; starting a fresh one", flush=True)
        except KeyboardInterrupt:
            print("stopping", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
