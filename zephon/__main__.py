"""``python -m zephon``: the ``zephon`` command, for scripts that start it with the same
interpreter (``sys.executable``) rather than whatever ``zephon`` is first on ``PATH``."""

from zephon.cli import entry_point

entry_point()
