"""LoRA adapters through a real `octo serve` and the official openai SDK (issue 22, point 2).

One server from a models file: the tiny synthetic f32 GGUF with two synthetic GGUF LoRA adapters (``lora: {x: ...,
y: ...}``) and, as a model of its own, the merged model of adapter x (built independently: ``W + alpha / rank * B @ A``
on the Hugging Face weights). ``base:x`` must answer what the merged model answers; the adapters are listed in
/v1/models with their parent; requests for different adapters run together; a prefix cached for one adapter never
serves another. A second server takes the adapter from ``--lora NAME=PATH``.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed")
openai = pytest.importorskip("openai")

from test_lora import LORA_X, LORA_Y  # noqa: E402

PROMPT = "The old lighthouse stood at the edge of the harbor, and every evening the keeper climbed the stairs"


@pytest.fixture(scope="module")
def files():
    from octo.synth.gguf import build_gguf
    from octo.synth.lora import build_gguf_lora, build_merged_gguf

    return {"base": build_gguf("tiny", 0, "f32"), "x": build_gguf_lora("tiny", 0, LORA_X),
            "y": build_gguf_lora("tiny", 0, LORA_Y), "merged_x": build_merged_gguf("tiny", 0, LORA_X)}


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    from serverproc import run_octo

    models = tmp_path_factory.mktemp("lora") / "models.yaml"
    models.write_text(f"models:\n  - model: {files['base']}\n    engine: llamacpp\n"
                      f"    lora: {{x: {files['x']}, y: {files['y']}}}\n"
                      f"  - model: {files['merged_x']}\n    engine: llamacpp\n")
    with run_octo("--models-file", str(models), "--max-batch", "8", "-o", "n_threads=2") as s:
        yield s


@pytest.fixture(scope="module")
def names(server):
    data = server.openai().models.list().data
    adapters = {m.id: m.model_extra for m in data if m.model_extra.get("parent")}
    base = next(m.model_extra["parent"] for m in data if m.model_extra.get("lora") == "x")
    merged = next(m.id for m in data if "merged" in m.id)
    return {"base": base, "x": f"{base}:x", "y": f"{base}:y", "merged": merged, "adapters": adapters}


def _complete(client, model, prompt=PROMPT, n=16):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    return r.choices[0].text, r.usage


def test_adapters_are_listed_with_their_parent(server, names):
    assert set(names["adapters"]) == {names["x"], names["y"]}
    for entry in names["adapters"].values():
        assert entry["parent"] == entry["root"] == names["base"] and entry["state"] == "ready"
    one = server.openai().models.retrieve(names["x"])
    assert one.id == names["x"] and one.model_extra["lora"] == "x"


def test_adapter_answers_what_the_merged_model_answers(server, names):
    client = server.openai()
    with_x, usage = _complete(client, names["x"])
    merged, _ = _complete(client, names["merged"])
    base, _ = _complete(client, names["base"])
    assert usage.completion_tokens == 16
    assert with_x == merged
    assert with_x != base
    chat = client.chat.completions.create(model=names["y"], messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    assert isinstance(text, str)


def test_adapters_batch_together_and_match_their_runs_alone(server, names):
    client = server.openai()
    models = [names["base"], names["x"], names["y"], names["merged"]]
    alone = {m: _complete(client, m, "Numbers can be written in many ways:", 8)[0] for m in models}

    async def together():
        aclient = server.async_openai()
        reqs = [aclient.completions.create(model=m, prompt="Numbers can be written in many ways:", max_tokens=8,
                                           temperature=0) for m in models * 2]
        return [r.choices[0].text for r in await asyncio.gather(*reqs)]

    texts = asyncio.run(together())
    assert texts == [alone[m] for m in models * 2]
    assert alone[names["x"]] == alone[names["merged"]]


def test_prefix_cache_never_serves_another_adapter(server, names):
    client = server.openai()
    # a prompt no earlier request of this module began with (a hit of x's own earlier entry would be legitimate)
    prompt = "Seven zebras crossed the frozen market square; " * 2 + PROMPT
    _complete(client, names["base"], prompt, 2)
    _, again = _complete(client, names["base"], prompt, 2)
    assert again.prompt_tokens_details.cached_tokens > 0  # the base model's own entry
    _, first_x = _complete(client, names["x"], prompt, 2)
    assert first_x.prompt_tokens_details.cached_tokens == 0  # computed with adapter x, not reused from the base
    _, second_x = _complete(client, names["x"], prompt, 2)
    assert second_x.prompt_tokens_details.cached_tokens > 0
    _, first_y = _complete(client, names["y"], prompt, 2)
    assert first_y.prompt_tokens_details.cached_tokens == 0


def test_unknown_adapter_is_a_404(server, names):
    with pytest.raises(openai.NotFoundError) as err:
        server.openai().completions.create(model=f"{names['base']}:nope", prompt="Hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and f"{names['base']}:x" in err.value.body["message"]


def test_lora_flag(files, server, names):
    from serverproc import run_octo

    expected, _ = _complete(server.openai(), names["merged"])
    with run_octo(str(files["base"]), "--engine", "llamacpp", "--lora", f"x={files['x']}", "-o", "n_threads=2") as s:
        client = s.openai()
        ids = [m.id for m in client.models.list().data if m.model_extra.get("parent")]
        assert ids == [names["x"]]
        assert _complete(client, names["x"])[0] == expected


def test_mlx_adapter_through_the_server(tmp_path):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'octo[mlx]')")
    from octo.engines.mlx import MLXEngine
    from serverproc import run_octo

    from octo.synth.lora import build_merged_hf, build_mlx_lora
    from octo.synth.mlx import build_mlx

    if not MLXEngine.detect().available:
        pytest.skip(f"MLX cannot run here: {MLXEngine.detect().reason}")
    base, adapter, merged = build_mlx("tiny"), build_mlx_lora("tiny", 0, LORA_X), build_merged_hf("tiny", 0, LORA_X)
    models = tmp_path / "models.yaml"
    models.write_text(f"- model: {base}\n  engine: mlx\n  lora: {{x: {adapter}}}\n- model: {merged}\n  engine: mlx\n")
    with run_octo("--models-file", str(models)) as s:
        client = s.openai()
        data = client.models.list().data
        name = next(m.id for m in data if m.model_extra.get("lora") == "x")
        merged_name = next(m.id for m in data if "merged" in m.id)
        assert _complete(client, name)[0] == _complete(client, merged_name)[0]
        assert _complete(client, name)[0] != _complete(client, name.rpartition(":")[0])[0]
