"""The OpenAI-compatible HTTP gateway (FastAPI)."""
