"""The OpenAI- and Anthropic-compatible HTTP API (docs/api.md).

``create_app(config, engine_client)`` in ``services.api.app`` builds the FastAPI app;
``EngineClient`` (``services.api.engine_client``) is the seam to whatever serves tokens.
Nothing here starts a server or an engine at import time.
"""
