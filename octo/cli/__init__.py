"""The ``octo`` command line (click): ``serve``, ``ps``, ``models``/``pull``, ``engines``, ``bench``.

The top layer: it builds the server (``octo.server``) and never runs below it. ``octo = "octo.cli.main:main"``.
"""

from octo.cli.main import cli, main

__all__ = ["cli", "main"]
