"""A client of edgerun's OpenAI-compatible API: streamed requests and their server-sent events (`edgerun chat`,
`edgerun bench serve`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

from edgerun.errors import EdgerunError

API_KEY_ENV = "EDGERUN_API_KEY"  # the API key `serve` requires and its clients send, where no --api-key is given


def _post_stream(url: str, body: dict, api_key: str | None):
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        return urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise EdgerunError(f"the server answered {e.code}: {message}") from e
    except urllib.error.URLError as e:
        raise EdgerunError(f"cannot reach {url}: {e.reason}") from e


def stream_events(url: str, body: dict, api_key: str | None) -> Iterator[dict]:
    """POST a streamed request to the API at `url` and yield its server-sent events' objects as they come; an error
    the server sends mid-answer, or answers with, is one line (EdgerunError)."""
    with _post_stream(url, body, api_key) as reply:
        for raw in reply:
            text = raw.decode("utf-8").strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            data = json.loads(text[6:])
            if "error" in data:
                raise EdgerunError(f"the server failed mid-answer: {data['error']['message']}")
            yield data
