"""`tl.metadata`: JSON values by (namespace, key) (SPEC section 9).

Any JSON value may be stored, `None` included; `get` returns `None` both for
an absent entry and for a stored `None` (the SPEC's `value | None`), so a
caller that must tell them apart stores a wrapper such as `{"v": None}`.
"""

from __future__ import annotations

from typing import Any

from ..kernel.validation import loads, require_id, require_json
from ..projections.folds import metadata as state
from .base import StoreFacade


class MetadataStore(StoreFacade):
    async def get(self, namespace: str, key: str) -> Any:
        require_id(namespace, "namespace")
        require_id(key, "key")
        raw = await self._read(state.value_key(namespace, key), state.partition_key(namespace, key))
        return None if raw is None else loads(raw)

    async def set(self, namespace: str, key: str, value: Any) -> None:
        require_id(namespace, "namespace")
        require_id(key, "key")
        text = require_json(value, "value")
        await self._send("threadlog.cmd.SetMetadata", state.partition_key(namespace, key),
                         {"namespace": namespace, "key": key, "value": text})

    async def delete(self, namespace: str, key: str) -> None:
        """Remove the entry; silent when it is absent."""
        require_id(namespace, "namespace")
        require_id(key, "key")
        await self._send("threadlog.cmd.DeleteMetadata", state.partition_key(namespace, key),
                         {"namespace": namespace, "key": key})
