"""Speculative decoding on the llama.cpp engine (``--draft``, ``-o n_draft``): greedy output identical to decoding
without a draft, with a draft that agrees (the model's own first layer: the later layers of the synthetic target are
made quiet) and with one that does not (another seed); several tokens a step with the agreeing draft; a draft with
another vocabulary refused at load with a clear error; and through a real `octo serve` with the official SDK: the
same text with and without the draft, streamed and not, max_tokens and stop strings ending a drafted run exactly
where an undrafted one ends."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402
from serverproc import run_octo  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402
from octo.errors import ConfigError  # noqa: E402
from octo.synth.spec import get_spec  # noqa: E402

TARGET = dataclasses.replace(get_spec("tiny"), name="tiny-deep", num_hidden_layers=4, quiet_from=1)
DRAFT = dataclasses.replace(TARGET, name="tiny-deep-draft", num_hidden_layers=1)
PROMPTS = [[(13 * i + 7 * j) % 3000 + 50 for j in range(20 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def models() -> dict[str, str]:
    from octo.synth.gguf import build_gguf

    return {"target": str(build_gguf(TARGET, ftype="f16")), "draft": str(build_gguf(DRAFT, ftype="f16")),
            "other": str(build_gguf("tiny", seed=5, ftype="f16"))}


def load(path, **opts) -> LlamaCppEngine:
    e = LlamaCppEngine(EngineConfig(max_batch=4, options={k: str(v) for k, v in opts.items()}))
    e.load(path, "target")
    return e


def generate(engine, prompts, n: int) -> tuple[list[list[int]], int]:
    """Greedy decoding of ``prompts`` together, taking a list result as consecutive tokens (as the scheduler does);
    returns the outputs and the number of steps."""
    seqs = [Sequence(id=i, tokens=list(p), sampling=SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add_sequence(s)
    out = {s.id: [] for s in seqs}
    feeds = [Feed(s, list(s.tokens), True) for s in seqs]
    steps = 0
    while feeds:
        res = engine.step(feeds)
        steps += 1
        nxt = []
        for f, r in zip(feeds, res, strict=True):
            for t in r if isinstance(r, list) else [r]:
                f.seq.tokens.append(t)
                out[f.seq.id].append(t)
                if len(out[f.seq.id]) >= n:
                    break
            if len(out[f.seq.id]) < n:
                assert f.seq.n_cached == len(f.seq.tokens) - 1
                nxt.append(Feed(f.seq, [f.seq.tokens[-1]], True))
        feeds = nxt
    for s in seqs:
        engine.remove_sequence(s)
    return [out[s.id] for s in seqs], steps


def test_greedy_output_is_identical_with_a_draft(models):
    plain = load(models["target"])
    want = [generate(plain, [p], 40)[0][0] for p in PROMPTS]
    plain_steps = generate(plain, [PROMPTS[0]], 40)[1]
    plain.unload()

    agreeing = load(models["target"], draft=models["draft"], n_draft=4, draft_p_min=0)
    got, steps = zip(*(generate(agreeing, [p], 40) for p in PROMPTS), strict=True)
    assert [g[0] for g in got] == want
    stats = agreeing.draft_stats()
    assert stats["proposed"] > 0 and stats["acceptance"] > 0.5, stats
    assert steps[0] < plain_steps * 0.6  # several tokens a step
    agreeing.unload()

    disagreeing = load(models["target"], draft=models["other"], n_draft=3, draft_p_min=0)
    assert [generate(disagreeing, [p], 40)[0][0] for p in PROMPTS] == want
    assert disagreeing.draft_stats()["acceptance"] < 0.5
    disagreeing.unload()

    # the default p_min (0.75): a random-weight draft is never that sure of a token, so it proposes (almost) nothing
    # and costs no verification
    unsure = load(models["target"], draft=models["other"], n_draft=3)
    assert [generate(unsure, [p], 40)[0][0] for p in PROMPTS] == want
    assert unsure.draft_stats()["proposed"] <= 0.1 * 40 * len(PROMPTS), unsure.draft_stats()
    unsure.unload()


def test_batched_drafted_sequences_each_get_their_own_output(models):
    plain = load(models["target"])
    want, _ = generate(plain, PROMPTS, 24)
    plain.unload()
    e = load(models["target"], draft=models["draft"], draft_max_batch=4, draft_p_min=0)
    got, _ = generate(e, PROMPTS, 24)
    assert e.draft_stats()["proposed"] >= 24  # every sequence of the batch was drafted
    e.unload()
    # the same batch with and without drafts: the verify rows change the batch's shape, and llama.cpp is not
    # batch-invariant (measured here: every token equal; a near tie may flip on another CPU)
    agree = sum(x == y for a, b in zip(got, want, strict=True) for x, y in zip(a, b, strict=True))
    assert agree >= 0.9 * 24 * len(PROMPTS), (agree, got, want)
    assert all(a[:4] == b[:4] for a, b in zip(got, want, strict=True))


def test_bad_draft_options_are_config_errors(models):
    with pytest.raises(ConfigError, match="draft_p_min"):
        load(models["target"], draft=models["draft"], draft_p_min=1.5)
    with pytest.raises(ConfigError, match="n_draft"):
        load(models["target"], draft=models["draft"], n_draft=0)
    with pytest.raises(ConfigError, match="draft"):
        load(models["target"], draft="/nonexistent/draft.gguf")


def test_a_draft_with_another_vocabulary_is_refused(models, tmp_path):
    from octo.synth.gguf import build_gguf

    odd = build_gguf(dataclasses.replace(DRAFT, name="tiny-draft-wide", vocab_size=DRAFT.vocab_size + 64), ftype="f16")
    with pytest.raises(ConfigError, match="vocabulary"):
        load(models["target"], draft=str(odd))


def test_served_with_a_draft_through_the_sdk(models, tmp_path):
    import yaml

    for name in ("plain", "drafted"):  # the same model twice, under two paths
        (tmp_path / f"{name}.gguf").symlink_to(models["target"])
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": [
        {"model": str(tmp_path / "plain.gguf"), "engine": "llamacpp"},
        {"model": str(tmp_path / "drafted.gguf"), "engine": "llamacpp",
         "options": {"draft": models["draft"], "n_draft": 4, "draft_p_min": 0}}]}))
    with run_octo("--models-file", str(path)) as server:
        client = server.openai()
        ids = {m["id"].rsplit("/", 1)[-1].split(".")[0]: m["id"] for m in server.get_json("/v1/models")["data"]}
        assert {"plain", "drafted"} <= set(ids), ids

        def ask(model, **kw):
            r = client.completions.create(model=ids[model], prompt="The old lighthouse", temperature=0, **kw)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

        for kw in ({"max_tokens": 30}, {"max_tokens": 7}, {"max_tokens": 1}):
            assert ask("drafted", **kw) == ask("plain", **kw)
        text = ask("plain", max_tokens=30)[0]
        assert len(text) > 14
        stop = text[10:14]  # a stop string inside a drafted run: both end at it
        assert ask("drafted", max_tokens=30, stop=[stop]) == ask("plain", max_tokens=30, stop=[stop])
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=ids["drafted"], prompt="The old lighthouse", temperature=0, max_tokens=30, stream=True) if c.choices)
        assert streamed == text
        chat = [client.chat.completions.create(model=ids[m], temperature=0, max_tokens=20, messages=[
            {"role": "user", "content": "Say something."}]).choices[0].message.content for m in ("plain", "drafted")]
        assert chat[0] == chat[1]


def test_a_failing_draft_costs_speed_not_requests(models):
    plain = load(models["target"])
    want = generate(plain, [PROMPTS[1]], 12)[0]
    plain.unload()
    e = load(models["target"], draft=models["draft"], draft_p_min=0)

    def broken(*args, **kwargs):
        raise RuntimeError("the draft model's decode failed")

    e.spec.drafter.propose = broken  # e.g. its KV full: every step decodes without a draft
    assert generate(e, [PROMPTS[1]], 12)[0] == want
    assert e.draft_stats()["proposed"] == 0
    e.unload()
