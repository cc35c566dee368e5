"""Roll a module version out to every tmod replica, one replica at a time, without a restart.

Each replica is told to load the version from its (shared) store through the admin API
(`POST /admin/modules/{task}/{action}`, bearer token from the TMOD_ADMIN_TOKEN environment
variable, never from the command line); a load swaps the head between batches, so no request is
dropped, and a refused artifact (checksum, backbone fingerprint, shapes) changes nothing on that
replica. After each call the replica's `GET /admin/modules` (the same token: it works whether or not the
server asks for an API key on its other routes) must report the new version.

Replicas are named by --hosts (HOST:PORT,...) or found by --dns NAME: a headless Service
(deploy/k8s/base/service-headless.yaml) resolves to the address of every ready pod. The images
ship this script at /app/deploy/rollout_modules.py; Kubernetes use, from deploy/README.md:

    # from inside each pod (the pod already has the token in its environment)
    for p in $(kubectl get pods -l app.kubernetes.io/name=tmod,app.kubernetes.io/component=server -o name); do
        kubectl exec "$p" -- python /app/deploy/rollout_modules.py sentiment --version 2 --hosts 127.0.0.1:8080
    done
    # or as a Job inside the cluster: deploy/k8s/examples/rollout-job.yaml (uses --dns tmod-headless)

Standard library only. Exit status 0 when every replica reports the version, 1 otherwise (the
replicas already done keep the new version: run again, or roll back by loading the old one).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import urllib.error
import urllib.request


TASK_NAME = re.compile(r"[a-z0-9][a-z0-9_\-]{0,63}")  # the store's rule for task names (modules_store)


def is_port(text: str) -> bool:
    return text.isdigit() and 0 < int(text) < 65536


def port_number(text: str) -> int:
    """argparse type: a TCP port."""
    if not is_port(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return int(text)


def positive(text: str) -> float:
    """argparse type: seconds, over 0 (0 would make every call fail at once)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds over 0")
    return seconds


def with_port(host: str, port: int) -> str:
    """HOST:PORT as given, or HOST (a name, an IPv4 address, a bracketed IPv6 one) with `port`;
    ValueError for a port that is none and an IPv6 address out of its brackets."""
    if host.startswith("["):
        _, bracket, rest = host.partition("]")
        if not bracket or rest and not rest.startswith(":"):
            raise ValueError(f"{host!r} is not [IPv6]:PORT")
    elif host.count(":") > 1:
        raise ValueError(f"{host!r}: an IPv6 address goes in brackets ([::1]:8080)")
    else:
        rest = host[host.index(":"):] if ":" in host else ""  # ':PORT' or ''
    if not rest:
        return f"{host}:{port}"
    if not is_port(rest[1:]):
        raise ValueError(f"{host!r}: {rest[1:]!r} is not a port (1-65535)")
    return host


def resolve(name: str, port: int) -> list[str]:
    """Every address a (headless Service) DNS name resolves to, as HOST:PORT, sorted."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({info[4][0] for info in infos})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


class Unreachable(Exception):
    """A replica that did not answer at all (refused, timed out, no route): its reason."""


def call(opener, method: str, url: str, token: str | None = None, body: dict | None = None, timeout: float = 120):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("content-type", "application/json")
    if token:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (urllib.error.URLError, OSError) as exc:  # refused, timed out: one line, not a traceback
        raise Unreachable(str(getattr(exc, "reason", exc))) from None


def roll_out(hosts: list[str], task: str, version: str | None, action: str, token: str,
             timeout: float = 120, log=print) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for done, host in enumerate(hosts):
        try:
            changed = roll_out_one(opener, host, task, version, action, token, timeout, log)
        except Unreachable as exc:
            log(f"{host}: no answer ({exc})")
            changed = False
        if not changed:  # the replicas now serve two versions where some were done: said, with the way back
            left = len(hosts) - done - 1
            log(f"stopped at {host}: " + (f"{done} replica(s) before it ({', '.join(hosts[:done])}) have the change"
                                          if done else "no replica was changed")
                + (f", the {left} after it were not asked" if left else "")
                + ("; run again once it is mended, or roll back with --version of the one they served" if done else ""))
            return False
    return True


def roll_out_one(opener, host: str, task: str, version: str | None, action: str, token: str, timeout: float,
                 log) -> bool:
    """One replica: the change, then the check that it took. False (said) where it did not."""
    base = f"http://{host}"
    status, body = call(opener, "POST", f"{base}/admin/modules/{task}/{action}", token, {"version": version}, timeout)
    if status != 200:
        log(f"{host}: {action} {task} failed: HTTP {status} {json.dumps(body)}")
        return False
    status, listing = call(opener, "GET", f"{base}/admin/modules", token, timeout=timeout)
    served = ((listing or {}).get("tasks") or {}).get(task) if status == 200 else None
    if action == "unload":
        if status != 200 or served is not None:
            log(f"{host}: {task} still served after unload (HTTP {status}, version {served!r})")
            return False
        log(f"{host}: unloaded {task} (was version {body.get('version')})")
        return True
    if served != body.get("version") or (version is not None and served != version):
        log(f"{host}: {task} serves version {served!r} after {action}, expected {version or body.get('version')!r}")
        return False
    log(f"{host}: {task} version {served} (was {body.get('previous_version')})")
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", help="the task whose module every replica changes (a folder of the shared store)")
    p.add_argument("--version", default=None, help="version to load (default: each replica's newest for its backbone, "
                   "as tmod-serve picks one)")
    p.add_argument("--action", choices=("load", "reload", "unload"), default="load",
                   help="load (the version), reload (the served version, its files read again) or unload (default: load)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", help="comma-separated HOST:PORT of every replica (a HOST alone: --port)")
    where.add_argument("--dns", help="a name that resolves to every replica (a headless Service)")
    p.add_argument("--port", type=port_number, default=os.environ.get("TMOD_PORT", "8080"),
                   help="port with --dns, or of a --hosts entry without one (default: $TMOD_PORT, else 8080)")
    p.add_argument("--timeout", type=positive, default=120.0, help="seconds per call")
    args = p.parse_args(argv)
    token = os.environ.get("TMOD_ADMIN_TOKEN")
    if not token:
        print("TMOD_ADMIN_TOKEN is not set: export the admin token the replicas were started with (it is read "
              "from the environment only, never from the command line)", file=sys.stderr)
        return 2
    if not TASK_NAME.fullmatch(args.task):  # it becomes part of the URL: '../x' would reach another route
        print(f"{args.task!r} is not a module name: 1-64 of a-z, 0-9, '_' and '-', starting with a letter or digit",
              file=sys.stderr)
        return 2
    try:
        hosts = [with_port(h.strip(), args.port) for h in args.hosts.split(",") if h.strip()] if args.hosts \
            else resolve(args.dns, args.port)
    except OSError as exc:  # a name that does not resolve (a typo, another namespace)
        print(f"--dns {args.dns}: does not resolve ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except ValueError as exc:  # a --hosts entry that is no address
        print(f"--hosts: {exc}", file=sys.stderr)
        return 2
    if not hosts:
        print("no replicas found", file=sys.stderr)
        return 2
    what = "" if args.action == "unload" else f" version {args.version or 'newest'}"
    print(f"{args.action} {args.task}{what} on {len(hosts)} replica(s)", flush=True)
    return 0 if roll_out(hosts, args.task, args.version, args.action, token, args.timeout,
                         log=lambda m: print(m, flush=True)) else 1


if __name__ == "__main__":
    sys.exit(main())
