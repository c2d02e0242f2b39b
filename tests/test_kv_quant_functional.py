"""KV-cache quantization through a real `octo serve` and the official openai SDK (issue 22, point 1).

``-o cache_type=q8_0`` on the synthetic demo GGUF: the option reaches llama.cpp (/v1/engines shows the type, flash
attention on and the KV bytes per token), greedy answers agree with an f16-cache server on the first token for at
least 6 of 8 prompts (measured: 8 of 8; random weights: see tests/test_kv_quant.py), and an engine that cannot
quantize its KV cache (MLX) refuses to start with a message naming the engine.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed")
openai = pytest.importorskip("openai")

from test_kv_quant import _prompt  # noqa: E402

PROMPTS = [_prompt(200 + i, 10 + i) for i in range(8)]


@pytest.fixture(scope="module")
def demo():
    from octo.synth.gguf import build_gguf

    return str(build_gguf("demo", 0, "f16"))


def _first_tokens(server, model):
    client = server.openai()
    out = []
    for p in PROMPTS:
        r = client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0, logprobs=1)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        out.append(r.choices[0].logprobs.tokens)
    return out


def test_q8_0_cache_serves_and_agrees_with_f16(demo):
    from serverproc import run_octo

    results, rows = {}, {}
    for t in ("f16", "q8_0"):
        with run_octo(demo, "--engine", "llamacpp", "-o", f"cache_type={t}", "-o", "n_threads=2") as s:
            model = s.openai().models.list().data[0].id
            rows[t] = json.dumps(s.get_json("/v1/engines"))
            results[t] = _first_tokens(s, model)
    assert '"cache_type": "q8_0"' in rows["q8_0"] and '"kv_bytes_per_token": 1088' in rows["q8_0"]
    assert '"cache_type": "f16"' in rows["f16"] and '"kv_bytes_per_token": 2048' in rows["f16"]
    first = sum(a[0] == b[0] for a, b in zip(results["f16"], results["q8_0"], strict=True))
    assert first >= 6, (results["f16"], results["q8_0"])


def test_an_engine_without_a_quantized_cache_refuses_to_start():
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from serverproc import run_octo

    from octo.synth.mlx import build_mlx

    folder = str(build_mlx("tiny"))
    with pytest.raises(RuntimeError) as err, run_octo(folder, "--engine", "mlx", "-o", "cache_type=q4_0", timeout=60):
        pass
    assert "cache_type=q4_0 is not supported by the mlx engine" in str(err.value)
