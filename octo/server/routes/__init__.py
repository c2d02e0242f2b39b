"""Route handlers, one module per API family (OpenAI, Anthropic, Responses, tokens, audio, dashboard)."""
