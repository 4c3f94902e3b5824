"""The README's examples as a reader runs them: every `edgerun` command in it is one the CLI accepts, the quick
ones that need no root, no other machine and no file of the reader's run as written, and the serving
walk-through (serve, the OpenAI snippet, chat, status) works against a live server."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from edgerun.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)


def commands() -> list[str]:
    """Every shell line of the README's code blocks, comments cut."""
    out = []
    for lang, block in BLOCKS:
        if lang:
            continue
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                out.append(line)
    return out


def edgerun_commands() -> list[str]:
    """`edgerun ...` lines, also those run with sudo or inside another command (testbed run -- edgerun ...)."""
    found = []
    for line in commands():
        if not line.startswith(("edgerun ", "sudo ", "pip ")):  # the layout block, chromium, python scripts
            continue
        for part in line.split("&&"):
            words = shlex.split(part)
            while words and words[0] == "sudo":
                words = words[1:]
            if words and words[0] == "edgerun":
                found.append(shlex.join(words))
    return found


# Run as written: fast, no root, no other machine, no file the reader must bring, nothing left running.
RUN_AS_WRITTEN = [
    'edgerun generate "Once upon a time" --max-tokens 100',
    'edgerun generate "Name three rivers." --chat',
    'edgerun generate "Tell a story" --temperature 1.0 --top-p 0.9 --seed 7',
    'edgerun generate "The capital of France is" --greedy',
    "edgerun model info",
    "edgerun bench serve --parallel 4 --streams 1,4 --max-tokens 16",
    "edgerun bench serve --workers 2 --parallel 4 --streams 1,4 --max-tokens 16",
    "edgerun plan --devices profiles/rpi4-8gb.json profiles/rpi5-8gb.json --plan halo --out plan.json",
    "edgerun plan --devices profiles/*.json --plan dp",
]


def test_every_edgerun_command_in_the_readme_parses() -> None:
    parser = build_parser()
    seen = edgerun_commands()
    assert len(seen) > 30
    for command in seen:
        words = shlex.split(command)[1:]
        if words[:2] == ["testbed", "run"] and "--" in words:  # the command after -- is checked on its own
            words = words[:words.index("--")]
        words = [x for w in words for x in (sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(w)) if "*" in w
                                            else [w])]
        try:
            parser.parse_args(words)
        except SystemExit as e:
            pytest.fail(f"the README's `{command}` is refused by the CLI (exit {e.code})")


def edgerun_env() -> dict[str, str]:
    """The environment with this Python's `edgerun` first on PATH, as after the README's set-up."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def wait_for_health(server: subprocess.Popen, what: str) -> float:
    """Until the server started as `what` answers /health on port 8000 (failing if it exits); returns the deadline
    it kept, 180 s from its start, for what follows."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen("http://localhost:8000/health", timeout=2)
            break
        except OSError:
            if server.poll() is not None:
                pytest.fail(f"{what} exited: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
    return deadline


@pytest.mark.parametrize("command", RUN_AS_WRITTEN)
def test_quick_readme_commands_run_as_written(command: str, tmp_path: Path, shipped_path: Path) -> None:
    assert command in [re.sub(r"\s+", " ", c) for c in commands()], "the README no longer says this"
    # From the checkout (profiles/ is there), writing into a scratch copy of nothing: plan.json goes to tmp_path.
    env = edgerun_env()
    shell = command.replace("--out plan.json", f"--out {tmp_path / 'plan.json'}")
    done = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


@pytest.mark.slow
def test_the_serving_walkthrough(shipped_path: Path, tmp_path: Path) -> None:
    """`edgerun serve`, the README's Python snippet with the openai client, `edgerun chat` and `edgerun status`,
    as written (port 8000)."""
    snippet = next(block for lang, block in BLOCKS if lang == "python")
    env = edgerun_env()
    server = subprocess.Popen(["edgerun", "serve", "--no-advertise"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for_health(server, "edgerun serve")
        (tmp_path / "snippet.py").write_text(snippet)
        ran = subprocess.run([sys.executable, str(tmp_path / "snippet.py")], capture_output=True, text=True,
                             timeout=300)
        assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr
        chat = subprocess.run(["edgerun", "chat", "--max-tokens", "16"], input="Hello!\n\n", capture_output=True,
                              text=True, timeout=300, env=env)
        assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
        status = subprocess.run(["edgerun", "status"], capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode == 0 and "from the single engine" in status.stdout, status.stderr
    finally:
        server.terminate()
        server.wait(30)


# Commands the README shows together: a server, and what joins it from another device (here from this one).
PAIRS = [
    ("edgerun serve --key SECRET", "edgerun node --key SECRET"),
    ("edgerun serve --plan dp --no-local --wait 60 --key SECRET", "edgerun node --mode pp --key SECRET"),
]


def test_the_paired_commands_are_the_readmes() -> None:
    written = edgerun_commands()
    for server, node in PAIRS:
        assert server in written and node in written, (server, node)


@pytest.mark.slow
@pytest.mark.parametrize(("server_command", "node_command"), PAIRS)
def test_paired_readme_commands_join_and_serve(server_command: str, node_command: str, shipped_path: Path) -> None:
    """A server and a node started exactly as the README writes them (the node finds the server by mDNS): the node
    joins, and a request is answered; a pipeline without the server's own engine answers from the worker."""
    import json

    env = edgerun_env()
    server = subprocess.Popen(shlex.split(server_command), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=env)
    node = None
    try:
        deadline = wait_for_health(server, server_command)
        node = subprocess.Popen(shlex.split(node_command), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env)

        def state() -> dict:
            with urllib.request.urlopen("http://localhost:8000/api/state", timeout=10) as r:
                return json.loads(r.read())

        while time.monotonic() < deadline and not any(n["alive"] for n in state()["nodes"]):
            if node.poll() is not None:
                pytest.fail(f"{node_command} exited: {node.stderr.read()[-2000:]}")
            time.sleep(0.5)
        assert any(n["alive"] for n in state()["nodes"]), state()
        request = urllib.request.Request(
            "http://localhost:8000/v1/chat/completions",
            json.dumps({"model": "any", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}).encode(),
            {"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["message"]["content"].strip(), answer
        if "--no-local" in server_command:
            assert state()["mode"] == "cluster"
    finally:
        for proc in (node, server):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_the_first_command_answers_sensibly(shipped_path: Path) -> None:
    """README command 1's `edgerun generate ...`, as written: the shipped model says Paris, and says it again."""
    setup = next(line for line in commands() if line.startswith("pip install -e . && edgerun generate"))
    argv = shlex.split(setup.split("&&", 1)[1])
    assert argv[:2] == ["edgerun", "generate"], argv
    runs = [subprocess.run([sys.executable, "-m", "edgerun.cli", *argv[1:]], capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert "Paris" in runs[0].stdout and runs[0].stdout == runs[1].stdout, (runs[0].stdout, runs[1].stdout)
