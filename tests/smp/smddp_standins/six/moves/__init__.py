"""``six.moves.urllib`` is the standard library's ``urllib``, with ``urllib.request`` imported."""
from __future__ import annotations

import urllib
import urllib.request  # noqa: F401  (an attribute of urllib from here on)

__all__ = ["urllib"]
