"""`frawd serve`: an OpenAI-compatible HTTP API and a chat page over the continuous-batching
scheduler (`frawdllm.infer.scheduler`). `app.py` holds the routes, `schemas.py` the request
bodies, `static/index.html` the page."""

from .app import ApiError, ServeOptions, create_app, server_config

__all__ = ["create_app", "ServeOptions", "ApiError", "server_config"]
