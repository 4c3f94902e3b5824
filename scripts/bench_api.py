"""What the HTTP API adds per token: `edgerun serve` (single engine, 1 thread) answers streaming requests from
the official openai client; per request, the time between the first and the last streamed token, per token,
is set against the engine's own decode time per token for the same request (the server's
edgerun_ms_per_token histogram, read from /metrics before and after).

    python scripts/bench_api.py [--model M] [--requests 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import urllib.request

import openai


def histogram(url: str) -> tuple[float, int]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    total = float(re.search(r"^edgerun_ms_per_token_sum (\S+)", text, re.M).group(1))
    count = int(re.search(r"^edgerun_ms_per_token_count (\d+)", text, re.M).group(1))
    return total, count


class Standalone:
    """The same engine in this process, with no server (1 thread): its decode ms/token on a request."""

    def __init__(self, model_path: str | None) -> None:
        from edgerun.model.generate import make_engine
        from edgerun.model.loader import load_model

        self.model = load_model(model_path)
        self.engine = make_engine("onnx", self.model, 2048, threads=1)

    def ms_per_token(self, prompt: str, tokens: int, seed: int) -> float:
        from edgerun.model.generate import generate
        from edgerun.model.sampling import Sampler, SamplingParams

        result = generate(self.engine, self.model.tokenizer.encode(prompt), tokens,
                          Sampler(SamplingParams(0.8, seed=seed)))
        return result.decode_s / (len(result.tokens) - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the shipped model)")
    ap.add_argument("--requests", type=int, default=5, help="streamed requests measured (default: 5)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (default: 64)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "edgerun.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--no-cluster",
           "--threads", "1"] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = ""
        for line in proc.stderr:  # type: ignore[union-attr]
            found = re.search(r"at (http://[\d.]+:\d+) ", line)
            if found:
                url = found.group(1)
                break
        if not url:
            raise SystemExit("edgerun serve did not start")
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        alone = Standalone(args.model)
        rows = []
        for i in range(args.requests + 1):  # the first warms up
            # Server and standalone engine take turns on the same request, so the host's drift hits both.
            prompt = f"Story {i}: once upon a time"
            alone_ms = alone.ms_per_token(prompt, args.tokens, i)
            before = histogram(url)
            times = []
            for c in client.completions.create(model="m", prompt=prompt,
                                               max_tokens=args.tokens, temperature=0.8, seed=i, stream=True):
                if c.choices and c.choices[0].text:
                    times.append(time.perf_counter())
            after = histogram(url)
            if i == 0 or len(times) < 2 or after[1] != before[1] + 1:
                continue
            client_ms = (times[-1] - times[0]) / (len(times) - 1) * 1e3
            engine_ms = after[0] - before[0]
            rows.append((client_ms, engine_ms, alone_ms))
            print(f"request {i}: {len(times)} pieces; ms/token: client {client_ms:.2f}, the server's engine "
                  f"{engine_ms:.2f}, the engine alone {alone_ms:.2f}", flush=True)
        client_mean, engine_mean, alone_mean = (sum(r[k] for r in rows) / len(rows) for k in range(3))
        print(f"mean over {len(rows)} requests, ms/token: client {client_mean:.2f}, the server's engine "
              f"{engine_mean:.2f}, the same engine in a process of its own {alone_mean:.2f}: the API adds "
              f"{client_mean - alone_mean:+.2f} ms/token over the engine alone")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
