"""What a pipeline master serves over HTTP, as Starlette routes: workers' WebSockets (`/ws`), stage files by
content hash (`/files/<sha256>`), the browser node page and its scripts (`/node`, `/ort/...`) and a plain-text
status (`/status`). `edgerun master --plan dp` serves them alone; `edgerun serve --plan dp` beside its API, on
one port."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from edgerun.pp.workers import WorkerLink, Workers

PAGE_SCRIPTS = ("node.js", "frames.js", "sampling.js", "expert.js", "kernels.js", "kernels.wasm")
# What the page needs beyond the checkout's files: npm's packages, and kernels.wasm, which npm's postinstall builds.
NPM_BUILT = ("node_modules/onnxruntime-web/dist/ort.all.min.mjs", "kernels.wasm")
_said_missing: set[Path] = set()
_installing: list[Path] = []  # the browser directory npm is (or was) building in this process


def browser_dir() -> Path:
    """The browser node page and its npm packages: $EDGERUN_BROWSER_DIR, else browser/ of this checkout."""
    return Path(os.environ.get("EDGERUN_BROWSER_DIR", Path(__file__).resolve().parents[2] / "browser"))


# The node page and everything it loads are served cross-origin isolated: only then may a page share memory
# between threads (SharedArrayBuffer), which onnxruntime-web's WebAssembly needs to compute with several.
ISOLATED = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
            "Cross-Origin-Resource-Policy": "same-origin"}


def _page_file(path: Path, log: Callable[[str], None] = lambda _: None) -> Response:
    if not path.is_file():
        fix = f"run `{shlex.join(npm_install())}` for the browser node's packages"
        if path not in _said_missing:  # once: a tab asks for it on every load
            _said_missing.add(path)
            log(f"a browser tab asked for {path.name}, which is missing: {fix}")
        return PlainTextResponse(f"{path} is missing: {fix}\n", status_code=404)
    # The page and its scripts change with the package: a tab reloaded after an upgrade must not mix versions.
    return FileResponse(path, headers={"Cache-Control": "no-cache", **ISOLATED})


def npm_install() -> list[str]:
    """The command that fetches and builds the browser node's packages."""
    return ["npm", "install", "--prefix", str(browser_dir())]


def missing_page_files() -> list[str]:
    """The browser node's files not yet built or fetched (NPM_BUILT)."""
    return [name for name in NPM_BUILT if not (browser_dir() / name).is_file()]


def say_if_tabs_cannot_join(log: Callable[[str], None]) -> None:
    """At a master's start, where browser tabs could not load the node page yet: with npm here, fetch and build
    the page's files in the background (once a process), saying so; without it, one line with the command."""
    missing = missing_page_files()
    if not missing:
        return
    where, command = browser_dir(), npm_install()
    if shutil.which("npm") is None or not (where / "package.json").is_file() or _installing:
        log(f"browser tabs cannot join until `{shlex.join(command)}` has run (Node.js and npm): "
            f"{', '.join(missing)} missing")
        return
    _installing.append(where)
    log(f"browser tabs: {', '.join(missing)} missing; fetching and building them (`{shlex.join(command)}`, once, "
        "about a minute; tabs that come before then are told what the server lacks)")

    def install() -> None:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0 and not missing_page_files():
            log("browser tabs can join now: the node page's files are built")
        else:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            log(f"`{shlex.join(command)}` failed (status {done.returncode}: {last[0]}); browser tabs cannot join")

    threading.Thread(target=install, name="npm install", daemon=True).start()


def pipeline_routes(workers: Workers, files: dict[str, Path], status: Callable[[], str],
                    log: Callable[[str], None] = lambda _: None) -> list[BaseRoute]:
    """The routes of one pipeline master: `files` maps a stage file's sha256 to its path (filled as stages are
    built), `status` renders /status; `log` hears of a page file a tab asked for and the server lacks."""

    async def worker(ws: WebSocket) -> None:
        await ws.accept()
        await workers.serve(WorkerLink(ws))

    async def stage_file(request: Request) -> Response:
        path = files.get(request.path_params["sha256"])
        if path is None:
            return PlainTextResponse("no such stage file\n", status_code=404)
        return FileResponse(path, media_type="application/octet-stream", headers=ISOLATED)

    async def status_page(request: Request) -> Response:
        return PlainTextResponse(status())

    return [
        WebSocketRoute("/ws", worker),
        Route("/files/{sha256}", stage_file),
        Route("/status", status_page),
        *page_routes(log),
    ]


def page_routes(log: Callable[[str], None] = lambda _: None) -> list[BaseRoute]:
    """The browser node page, its scripts and onnxruntime-web's files (a pipeline master's and a MoEx hub's)."""

    async def node_page(request: Request) -> Response:
        return _page_file(browser_dir() / "node.html", log)

    def page_script(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def script(request: Request) -> Response:
            return _page_file(browser_dir() / name, log)

        return script

    async def runtime_file(request: Request) -> Response:
        name = request.path_params["name"]  # one path segment: nothing outside onnxruntime-web's dist
        if name.startswith("."):
            return PlainTextResponse("no such file\n", status_code=404)
        return _page_file(browser_dir() / "node_modules" / "onnxruntime-web" / "dist" / name, log)

    return [Route("/node", node_page), Route("/ort/{name}", runtime_file),
            *(Route(f"/{name}", page_script(name)) for name in PAGE_SCRIPTS)]
