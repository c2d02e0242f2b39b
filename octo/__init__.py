"""octo: an OpenAI-compatible local inference gateway that serves with the fastest engine on the host."""

import os as _os

__version__ = "0.1.0"

# A local server sends nothing anywhere. Some libraries octo loads report usage unless told not to: ONNX Runtime and
# onnxruntime-genai look up Microsoft's telemetry host from every process that loads them, huggingface_hub reports
# downloads. Off in every octo process (the gateway, its engine workers, synthetic builds), which inherit it, unless
# the operator set these variables.
for _name in ("ORT_DISABLE_TELEMETRY", "HF_HUB_DISABLE_TELEMETRY", "DO_NOT_TRACK"):
    _os.environ.setdefault(_name, "1")
