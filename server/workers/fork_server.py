"""Imported first by multiprocessing's fork server (the process that forks the HTTP workers), before
the app it preloads: it ignores SIGINT from then on. A terminal's Ctrl-C reaches every process of the
group, and one that came while the fork server imported the app (seconds: torch) killed it with a
traceback, and the engine, whose next worker could not start, with another. The engine stops its
workers itself; each worker's uvicorn takes SIGINT back, and the fork server ignores it once its
preload is done anyway."""
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
