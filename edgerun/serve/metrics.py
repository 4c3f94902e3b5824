"""What `edgerun serve` counts, in Prometheus's text exposition format (names prefixed edgerun_).

Counters and the histogram are written from the generation thread and read by the HTTP handlers; one lock
keeps a scrape consistent."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

# ms per output token: from a fast single device to a lossy cluster waiting out timeouts.
MS_BUCKETS = (5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = MS_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(MS_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            running += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.requests: Counter[int] = Counter()  # by HTTP status
        self.ms_per_token = Histogram()
        self.recoveries = 0
        self.switches = 0

    def request_done(self, status: int) -> None:
        with self.lock:
            self.requests[status] += 1

    def generation(self, prompt_tokens: int, completion_tokens: int, ms_per_token: float | None,
                   recoveries: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if ms_per_token is not None:
                self.ms_per_token.observe(ms_per_token)
            self.recoveries += recoveries

    def render(self, gauges: dict[str, tuple[str, dict[str, float]]], counters: dict[str, tuple[str, float]]) -> str:
        """The exposition text: this object's series, plus `gauges` (name -> help, {label value -> value} under
        a label named by the part of the name after its last '__') and extra `counters` (name -> help, value)."""
        with self.lock:
            lines = [
                "# HELP edgerun_prompt_tokens_total Prompt tokens prefilled.",
                "# TYPE edgerun_prompt_tokens_total counter",
                f"edgerun_prompt_tokens_total {self.prompt_tokens}",
                "# HELP edgerun_tokens_total Tokens generated.",
                "# TYPE edgerun_tokens_total counter",
                f"edgerun_tokens_total {self.completion_tokens}",
                "# HELP edgerun_requests_total Generation requests by HTTP status (499: its client left first).",
                "# TYPE edgerun_requests_total counter",
                *(f'edgerun_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())),
                "# HELP edgerun_ms_per_token Decode time per output token of each request, ms.",
                "# TYPE edgerun_ms_per_token histogram",
                *self.ms_per_token.lines("edgerun_ms_per_token"),
                "# HELP edgerun_recoveries_total Generations that lost a node and went on after a replan.",
                "# TYPE edgerun_recoveries_total counter",
                f"edgerun_recoveries_total {self.recoveries}",
            ]
        for name, (text, value) in counters.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name} {value:g}"]
        for name, (text, values) in gauges.items():
            metric, _, label = name.partition("__")
            lines += [f"# HELP {metric} {text}", f"# TYPE {metric} gauge"]
            lines += [f'{metric}{{{label}="{k}"}} {v:g}' if label else f"{metric} {v:g}" for k, v in values.items()]
        return "\n".join(lines) + "\n"
