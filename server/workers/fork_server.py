"""Imported first by multiprocessing's fork server (the process that forks the HTTP workers), before
the app it preloads: it ignores the stop signals (SIGTERM, SIGINT, SIGHUP) from then on; the engine
stops it (it exits when the engine process does). A signal sent to the whole process group reaches it
too: a terminal's Ctrl-C or SIGHUP, systemd's stop (KillMode=control-group signals every process of the
unit), `kill -TERM -PGID`. Ctrl-C while it imported the app (seconds: torch) killed it with a traceback,
and the engine, whose next worker could not start, with another; a SIGTERM or SIGHUP killed it while
the workers it forked were draining, and the engine, told by it that they had exited, closed their
connections under them: requests still in flight were answered 503.
A worker sets SIGTERM and SIGHUP back as it starts (run_worker) and its uvicorn takes all three over."""
import signal

from server.config import STOP_SIGNALS

for stop_signal in STOP_SIGNALS:
    signal.signal(stop_signal, signal.SIG_IGN)
