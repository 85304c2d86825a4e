"""`frawd serve`: an OpenAI-compatible HTTP API and a chat page over the continuous-batching
scheduler (`frawdllm.infer.scheduler`). `app.py` holds the routes (its docstring maps the
other modules), `static/index.html` the page."""

from .app import create_app, server_config
from .errors import ApiError
from .options import ServeOptions

__all__ = ["create_app", "ServeOptions", "ApiError", "server_config"]
