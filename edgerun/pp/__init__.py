"""Pipeline-parallel master and node engines over WebSocket."""
