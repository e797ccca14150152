"""HTTP for browsers and REST clients: a run's delivery log as SSE, thread hydration.

    from threadlog.http import create_app, routes
    app = create_app(tl)                                # a complete ASGI app
    Starlette(routes=[*routes(lambda: tl, "/api/chat")])  # or mount the routes in yours
"""

from .app import create_app, routes, thread_state

__all__ = ["create_app", "routes", "thread_state"]
