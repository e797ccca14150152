"""HTTP for browsers and REST clients: a run's delivery log as SSE, thread hydration.

    from threadlog.http import create_app, routes
    app = create_app(tl)                                # a complete ASGI app
    Starlette(routes=[*routes(lambda: tl, "/api/chat")])  # or mount the routes in yours

Who may read what: `create_app(tl, authorize=hook)` or `token_file=...`;
limits: `create_app(tl, limits=Limits(...))` (threadlog/http/guard.py).
"""

from .app import create_app, routes, thread_state
from .guard import Denied, Limits, StreamSlots, bearer_tokens, unauthenticated

__all__ = ["Denied", "Limits", "StreamSlots", "bearer_tokens", "create_app", "routes", "thread_state",
           "unauthenticated"]
