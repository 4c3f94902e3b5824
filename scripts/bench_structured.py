"""What structured output, tools and logprobs cost in decode speed: the same prompt decoded by the single engine
with a JSON Schema's grammar (and with logprobs, and with a tool call) against the same number of tokens decoded
unconstrained, passes alternated in one run.

    python scripts/bench_structured.py [--model PATH] [--threads 1] [--passes 5]

Prints each kind's decode tokens/s (median of the passes) and its ratio to the unconstrained decode of as many
tokens from the same prompt."""

from __future__ import annotations

import argparse
import json
import statistics

from edgerun.model.generate import generate, make_engine
from edgerun.model.loader import load_model
from edgerun.model.logits import LogitRules, LogitShaper, json_schema_grammar
from edgerun.model.sampling import USER_DEFAULTS, Sampler
from edgerun.serve.tools import ToolChoice, Tools, parse_tools

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"}},
    "required": ["name", "price"]}}}, "required": ["items"]}
TOOLS = [{"type": "function", "function": {"name": "order", "description": "Order fruit", "parameters": {
    "type": "object", "properties": {"fruit": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["fruit", "count"]}}}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the shipped model)")
    p.add_argument("--threads", type=int, default=1, help="the engine's threads (default: 1)")
    p.add_argument("--passes", type=int, default=5, help="alternated passes (default: 5)")
    args = p.parse_args()
    if args.model is None:
        from edgerun.model.fetch import fetch_smollm2
        args.model = fetch_smollm2()
    model = load_model(args.model)
    tok = model.tokenizer
    engine = make_engine("ggml", model, 1024, threads=args.threads)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "List five fruits with prices as "
                                                  f"JSON following this schema: {json.dumps(SCHEMA)}"}]))
    tools = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    assert isinstance(tools, Tools) and tools.choice == ToolChoice.REQUIRED
    kinds = {"json_schema": LogitRules(grammar=json_schema_grammar(SCHEMA)),
             "json_schema+logprobs": LogitRules(grammar=json_schema_grammar(SCHEMA), top_logprobs=5),
             "tool call": LogitRules(grammar=tools.grammar()), "logprobs": LogitRules(top_logprobs=5)}
    rates: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(args.passes):
        for kind, rules in kinds.items():
            shaper = LogitShaper(rules, tok, prompt, model.config.vocab_size)
            shaped = generate(engine, prompt, 400, Sampler(USER_DEFAULTS, shaper), tok.stop_ids)
            n = max(len(shaped.tokens), 2)
            plain = generate(engine, prompt, n, Sampler(USER_DEFAULTS), frozenset())  # as many tokens, no stop
            rates[kind].append((shaped.decode_tok_s, plain.decode_tok_s))
    for kind, pairs in rates.items():
        shaped_rate = statistics.median(a for a, _ in pairs)
        plain_rate = statistics.median(b for _, b in pairs)
        ratio = statistics.median(a / b for a, b in pairs)
        print(f"{kind}: {shaped_rate:.1f} tok/s against {plain_rate:.1f} unconstrained ({ratio:.2f}x, median of "
              f"{args.passes} paired passes)")


if __name__ == "__main__":
    main()
