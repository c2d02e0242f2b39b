"""The disk tier of the prefix cache on the llama.cpp engine (``--prefix-cache-dir``): a sequence state exported
from one engine instance and imported into a fresh one (a restart) continues exactly as a full prefill does; damaged
bytes are refused (a miss, never an error); and end to end through a real `octo serve` with the official SDK: a long
system prompt computed before a restart is a cached prefix after it, with the same greedy answer."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'octo[llamacpp]')")
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'octo[llamacpp]')")

from octo.engines.llamacpp import LlamaCppEngine  # noqa: E402
from serverproc import run_octo  # noqa: E402

from octo.engine import EngineConfig, Feed, SamplingParams, Sequence  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from octo.synth.gguf import build_gguf

    return str(build_gguf("tiny", ftype="q8_0"))


def fresh(path, **opts) -> LlamaCppEngine:
    e = LlamaCppEngine(EngineConfig(max_batch=4, options={k: str(v) for k, v in opts.items()}))
    e.load(path, "tiny")
    return e


def prefill(engine, seq) -> int:
    """Feed ``seq``'s unfed tokens; return the greedy next token."""
    tok = None
    while seq.n_cached < len(seq.tokens):
        chunk = seq.tokens[seq.n_cached: seq.n_cached + 256]
        tok = engine.step([Feed(seq, chunk, seq.n_cached + len(chunk) == len(seq.tokens))])[0]
    return tok


def greedy(engine, seq, n: int) -> list[int]:
    out = [prefill(engine, seq)]
    while len(out) < n:
        seq.tokens.append(out[-1])
        out.append(engine.step([Feed(seq, [out[-1]], True)])[0])
    return out


@pytest.mark.parametrize("opts", [{}, {"cache_seqs": 0}, {"kv_unified": "false"}])
def test_exported_state_restores_in_a_new_engine(gguf_path, opts):
    prompt = [(7 * i + 3) % 3000 + 100 for i in range(600)]
    a = fresh(gguf_path, **opts)
    seq = Sequence(id=0, tokens=list(prompt[:500]), sampling=SamplingParams(temperature=0))
    a.add_sequence(seq)
    prefill(a, seq)
    handle = a.kv_save(seq)
    data = a.kv_export(handle)
    assert data and len(data) > 500 * 64  # 500 cells of keys and values
    a.kv_free(handle)
    a.remove_sequence(seq)
    a.unload()

    b = fresh(gguf_path, **opts)  # a restart
    imported = b.kv_import(tuple(prompt[:500]), data)
    warm = Sequence(id=1, tokens=list(prompt), sampling=SamplingParams(temperature=0))
    b.add_sequence(warm)
    b.kv_restore(warm, imported, 500)
    assert warm.n_cached == 500
    got = greedy(b, warm, 12)
    b.remove_sequence(warm)
    cold = Sequence(id=2, tokens=list(prompt), sampling=SamplingParams(temperature=0))
    b.add_sequence(cold)
    assert got == greedy(b, cold, 12)
    b.remove_sequence(cold)

    damaged = b.kv_import(tuple(prompt[:500]), data[: len(data) // 2])  # llama.cpp refuses it when restoring
    seq = Sequence(id=3, tokens=list(prompt), sampling=SamplingParams(temperature=0))
    b.add_sequence(seq)
    b.kv_restore(seq, damaged, 500)
    assert seq.n_cached == 0
    assert greedy(b, seq, 12) == got
    b.remove_sequence(seq)
    b.unload()


def test_a_long_system_prompt_is_a_hit_after_a_restart(gguf_path, tmp_path):
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(60))
    args = (gguf_path, "--engine", "llamacpp", "-o", "n_ctx=2048", "--prefix-cache-dir", str(tmp_path))

    def ask(server, question):
        r = server.openai().chat.completions.create(
            model=server.get_json("/v1/models")["data"][0]["id"], temperature=0, max_tokens=8,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content, r.usage.prompt_tokens

    def disk(server):
        models = server.get_json("/v1/cache/stats")["models"]
        return next(iter(models.values()))["disk"]

    with run_octo(*args) as server:
        cached, _, n_prompt = ask(server, "What is a lighthouse?")
        assert cached == 0 and n_prompt > 300
        deadline = time.monotonic() + 20
        while disk(server)["writes"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert disk(server)["writes"] == 1
        cold = ask(server, "Name a colour.")  # a memory hit of the system prompt, for the answer to compare
    with run_octo(*args) as server:
        cached, answer, _ = ask(server, "Name a colour.")
        assert cached > 300, cached  # the system prompt came from disk
        assert answer == cold[1]
        assert disk(server)["hits"] == 1
