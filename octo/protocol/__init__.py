"""Pydantic request/response models per API (OpenAI, Anthropic, Responses). No aiohttp: they are pickled into
worker processes."""
