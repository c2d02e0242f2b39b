"""octo: an OpenAI-compatible local inference gateway that serves with the fastest engine on the host."""

__version__ = "0.1.0"
