"""Text that exists offline on every machine with Python, from two separate sources so that
predictors are never evaluated on what they were calibrated on:

- calibration: docstrings of standard-library modules, classes and functions;
- evaluation: the Python language reference topics that `help()` shows (`pydoc_data.topics`).
"""

from __future__ import annotations

import importlib
import inspect
import warnings

# Modules whose docstrings are plain English prose rather than tables or code.
CALIBRATION_MODULES = (
    "argparse", "asyncio", "calendar", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "email", "fractions", "functools", "heapq", "http.client", "inspect", "ipaddress", "itertools",
    "json", "logging", "os", "pathlib", "pickle", "queue", "random", "re", "shutil", "socket", "statistics",
    "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid",
    "zipfile",
)


def calibration_text(min_chars: int = 200) -> list[str]:
    """Docstrings of at least `min_chars`, each once, in a fixed order."""
    seen: set[str] = set()
    out = []
    for name in CALIBRATION_MODULES:
        module = importlib.import_module(name)
        with warnings.catch_warnings():  # deprecated aliases (typing.io) warn when looked at
            warnings.simplefilter("ignore", DeprecationWarning)
            objects = [module, *(v for _, v in sorted(vars(module).items())
                                 if inspect.isclass(v) or inspect.isfunction(v))]
            docs = [obj.__doc__ for obj in objects]
        for doc in docs:
            if not isinstance(doc, str):  # some classes carry a descriptor named __doc__
                continue
            doc = inspect.cleandoc(doc)
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                out.append(doc)
    return out


def evaluation_text(min_chars: int = 200) -> list[str]:
    """Language reference topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [text.strip() for _, text in sorted(topics.items()) if len(text.strip()) >= min_chars]
