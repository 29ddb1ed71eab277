"""Decode-time KV policies (one per file) and their registry."""
