"""Request preparation and response shaping per API (OpenAI, Anthropic, Responses, tokens, the response store).

Preparation (chat template, tokenization, tools, constraints) runs where the model is, in its worker; shaping
turns the scheduler's events into each API's JSON and stream chunks.
"""
