"""Avro protocol of threadlog: schemas (.avsc), single-object codec, compatibility."""

from .codec import Codec, CodecError, default_codec, fingerprint64
from .compat import check_compatibility, freeze

__all__ = ["Codec", "CodecError", "check_compatibility", "default_codec", "fingerprint64", "freeze"]
