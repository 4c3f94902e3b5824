"""The OpenAI-compatible (and Ollama) HTTP API over every engine and cluster, its dashboard and metrics."""
