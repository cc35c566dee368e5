"""Docker HEALTHCHECK for the tmod images: exit 0 when GET /healthz answers 200, else 1.

Standard library only (the image has no curl). Kubernetes ignores HEALTHCHECK and uses the
Deployment's probes instead (deploy/k8s/base/deployment.yaml).
"""
from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('TMOD_PORT', '8080')}/healthz"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    try:
        with opener.open(url, timeout=4) as response:
            ok = response.status == 200
    except Exception as exc:  # refused, timed out, HTTP error: all unhealthy
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
