"""`edgerun status`: a served or pipeline master's state."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    pass


def cmd_status(args: argparse.Namespace) -> None:
    """A served master's state (edgerun serve: /api/state), else a pipeline master's (/status)."""
    import urllib.error
    import urllib.request

    from edgerun.serve.status import status_text

    targets = [args.master] if args.master else ["127.0.0.1:8000", "127.0.0.1:7000"]
    key = args.api_key or os.environ.get("EDGERUN_API_KEY")
    reasons = []
    for target in targets:
        for path in ("/api/state", "/status"):
            url = f"http://{target}{path}"
            headers = {"authorization": f"Bearer {key}"} if key else {}
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
                    body = response.read().decode()
            except urllib.error.HTTPError as e:
                reasons.append(f"{url}: {e.code}" + (" (the server has an API key: --api-key or $EDGERUN_API_KEY)"
                                                     if e.code == 401 else ""))
                continue
            except OSError as e:
                reasons.append(f"{url}: {getattr(e, 'reason', e)}")
                break  # nothing listens there: the other path will not answer either
            sys.stdout.write(status_text(json.loads(body)) if path == "/api/state" else body)
            return
    raise EdgerunError("no master answered (" + "; ".join(reasons) + ")")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="a served or pipeline master's state, devices and plan",
                       description="Print what a running `edgerun serve` shows on its dashboard (engine in use, "
                                   "plan, every node with its state, memory, speed, RTT, loss and share, queue, "
                                   "recent events), or a pipeline master's state (Down, Preparing, Committing, Up) "
                                   "and each worker's kind, memory, layers and passes served.")
    p.add_argument("--master", default=None, help="HOST:PORT of the server's HTTP port or the pipeline master "
                   "(default: 127.0.0.1:8000, then 127.0.0.1:7000)")
    p.add_argument("--api-key", default=None, help="the server's API key, where it has one (default: "
                   "$EDGERUN_API_KEY)")
    p.set_defaults(func=cmd_status)
