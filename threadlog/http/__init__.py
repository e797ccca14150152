"""HTTP for browsers and REST clients: the delivery log over SSE, thread hydration."""
