"""Integrations with agent frameworks. Each submodule needs its framework's extra
(e.g. `pip install 'threadlog[langgraph]'` for `threadlog.integrations.langgraph`);
importing this package alone needs none of them."""
