"""A stand-in for ``six``: ``six.moves.urllib`` (Python 3's own ``urllib``)."""
