"""edgerun: one LLM across several small, unequal devices on a network that loses packets."""

__version__ = "0.1.0"
