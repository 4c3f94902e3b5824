"""Model files named by content: hashing (cached), serving a file over HTTP, fetching it.

Nodes load their share from their own copy of the model file. The master names its file by sha256;
a node whose copy differs, or that has none, downloads the master's over HTTP into its cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.cache import cache_root

if TYPE_CHECKING:  # the HTTP stack is imported where a file is served: fetching needs none of it (a worker starts
    # faster without it)
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import BaseRoute


def _hash_file(path: Path, digest: hashlib._Hash) -> None:
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)


def file_sha256(path: Path) -> str:
    """sha256 of one file, read in chunks."""
    digest = hashlib.sha256()
    _hash_file(path, digest)
    return digest.hexdigest()


def model_sha256(path: Path) -> str:
    """sha256 of a model file (or of a directory's files in name order), remembered per size and mtime."""
    path = path.resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    ident = json.dumps([[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    index = cache_root() / "hashes.json"
    known = json.loads(index.read_text()) if index.is_file() else {}
    if ident in known:
        return known[ident]
    digest = hashlib.sha256()
    for p in files:
        _hash_file(p, digest)
    known[ident] = digest.hexdigest()
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(json.dumps(known))
    return known[ident]


def model_routes(path: Path, sha256: str) -> list[BaseRoute]:
    """The route that serves a model file at /model/<sha256>."""
    from starlette.responses import FileResponse, PlainTextResponse
    from starlette.routing import Route

    async def model_file(request: Request) -> Response:
        if request.path_params["sha256"] != sha256 or not path.is_file():
            return PlainTextResponse("no such model\n", status_code=404)
        return FileResponse(path, media_type="application/octet-stream")

    return [Route("/model/{sha256}", model_file)]


class ModelServer:
    """Serves exactly one file at /model/<sha256> on a port of its own; everything else is 404."""

    def __init__(self, path: Path, sha256: str, host: str = "0.0.0.0", port: int = 0) -> None:
        from starlette.applications import Starlette

        from edgerun.net.http_server import HttpServer, bind

        self.http = HttpServer(Starlette(routes=model_routes(path, sha256)), bind(host, port))
        self.port = self.http.port

    def close(self) -> None:
        self.http.close()


def fetch_checked(url: str, target: Path, sha256: str,
                  progress: Callable[[int, int], None] | None = None) -> int:
    """Stream `url` into `target` (a cache file named by its content) if its sha256 is `sha256`; the bytes fetched.
    The partial file is named per process and thread, so fetchers sharing a cache do not trip over each other;
    a file that arrives with another hash leaves nothing behind (OSError). `progress(done, total)` after each
    chunk (total 0 when the server does not say)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
    digest = hashlib.sha256()
    done = 0
    with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as f:
        total = int(response.headers.get("Content-Length", 0))
        while chunk := response.read(1 << 20):
            f.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise OSError(f"{url} arrived with another sha256")
    os.replace(partial, target)
    return done


def fetch_model(base_url: str, sha256: str, suffix: str = ".gguf") -> Path:
    """The model file a master serves at `base_url` (http://HOST:PORT), from the cache or downloaded (with
    progress) and checked."""
    out = cache_root() / "models" / f"{sha256}{suffix}"
    if out.is_file():
        return out
    shown = [-1]

    def progress(done: int, total: int) -> None:
        percent = done * 100 // total if total else 0
        if percent // 10 != shown[0]:
            shown[0] = percent // 10
            print(f"downloading model: {percent}% of {total / 1e6:.0f} MB", file=sys.stderr, flush=True)

    fetch_checked(f"{base_url}/model/{sha256}", out, sha256, progress)
    return out
