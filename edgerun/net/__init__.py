"""Wire formats, channels, codecs, authentication and loss emulation."""
