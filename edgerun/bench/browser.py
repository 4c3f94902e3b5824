"""Headless Chromium tabs as pipeline workers, for benchmarks (and the tests that drive the browser node page):
Debian's Chromium driven by Playwright, which are optional (the `test` extra and `apt-get install chromium`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig
from edgerun.model.onnx_graph import StageSpec
from edgerun.model.session import StageSession

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"]
# Without --disable-gpu and with WebGPU enabled, headless Chromium offers a WebGPU adapter even on a machine
# without a GPU: SwiftShader's, which runs the shaders on the CPU (no shader-f16 there, so stages stay float32).
WEBGPU_FLAGS = [f for f in CHROMIUM_FLAGS if f != "--disable-gpu"] + ["--enable-unsafe-webgpu"]


@contextlib.contextmanager
def chromium_tabs(urls: Sequence[str], webgpu: bool = False) -> Iterator[list]:
    """One headless Chromium with a tab open at each URL (Playwright pages), closed on exit."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise EdgerunError("browser tabs need Playwright (pip install playwright, or the test extra)") from None
    if not Path(CHROMIUM).exists():
        raise EdgerunError(f"browser tabs need Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=WEBGPU_FLAGS if webgpu else CHROMIUM_FLAGS)
        try:
            pages = []
            for url in urls:
                pages.append(browser.new_page())
                pages[-1].goto(url)
            yield pages
        finally:
            browser.close()


def stage_pass_ms(graph_dir: Path, config: ModelConfig, spec: StageSpec, threads: int, passes: int = 32,
                  context: int = 512) -> float:
    """A native pass over one stage, one token at a time, in this process: the median ms of `passes`."""
    session = StageSession(graph_dir, config, spec.first_layer, spec.end_layer, context, threads)
    rng = np.random.default_rng(0)

    def one() -> np.ndarray:
        if spec.embed:
            return rng.integers(0, config.vocab_size, (1, 1), np.int64)
        return rng.standard_normal((1, 1, config.hidden)).astype(np.float32)

    session.run(one())  # the first pass allocates
    times = []
    for _ in range(passes):
        x = one()
        start = time.perf_counter()
        session.run(x)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3
