"""The HTTP gateway: the aiohttp application, its middlewares, routes per API family, metrics and the dashboard.

The only aiohttp code in octo (checked by the import contracts in pyproject.toml). Routes are thin: they parse
into ``octo.protocol`` models, call a model handle from ``octo.runtime``, and shape answers with ``octo.serving``.
"""
