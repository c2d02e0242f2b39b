"""``-o KEY=VALUE`` with several candidate engines: each engine gets only the options it declares
(``Engine.option_names``), an option no candidate takes is an error naming it, and the start-up benchmark's cache
keys a measurement by the options it ran with, so that a failure under options never stands for a plain start."""

from __future__ import annotations

import asyncio

import pytest
from serverproc import run_octo
from test_selection import Fast, _Cand, _Fake

from octo.config import ServerConfig
from octo.errors import ConfigError
from octo.runtime.loader import options_per_engine
from octo.runtime.selection import cache_key, select


class Threads(_Fake):  # takes n_threads and n_ctx, as llama.cpp does
    name = "threads"
    option_names = frozenset({"n_threads", "n_ctx"})


class Ctx(_Fake):  # takes n_ctx but not n_threads, as ONNX Runtime and MLX do
    name = "ctx"
    option_names = frozenset({"n_ctx", "threads"})


class Undeclared(Threads):  # a subclass that does not declare its own: it gets every option (and checks them itself)
    name = "undeclared"


def test_each_engine_gets_only_the_options_it_declares():
    lines: list[str] = []
    config = ServerConfig(options={"n_threads": "2", "n_ctx": "4096"})
    got = options_per_engine({"threads": Threads, "ctx": Ctx, "undeclared": Undeclared}, config, "demo",
                             lines.append)
    assert got["threads"].options == {"n_threads": "2", "n_ctx": "4096"} and got["threads"] is config
    assert got["ctx"].options == {"n_ctx": "4096"}
    assert got["undeclared"].options == config.options
    assert config.options == {"n_threads": "2", "n_ctx": "4096"}  # the model's own settings are left as they were
    assert lines == ["octo: -o n_threads is an option of threads, undeclared only: ctx runs without it"]


def test_an_option_no_candidate_takes_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"Unknown option 'n_thread': no engine that can serve 'demo' here "
                                          r"\(threads, ctx\) takes it; their options: n_ctx, n_threads, threads\."):
        options_per_engine({"threads": Threads, "ctx": Ctx}, ServerConfig(options={"n_thread": "2"}), "demo",
                           print)


def test_one_candidate_or_no_options_changes_nothing():
    config = ServerConfig(options={"bogus": "1"})  # one candidate: its engine refuses what it does not know
    assert options_per_engine({"ctx": Ctx}, config, "m", print) == {"ctx": config}
    plain = ServerConfig()
    assert options_per_engine({"threads": Threads, "ctx": Ctx}, plain, "m", print) == {"threads": plain, "ctx": plain}


def test_the_cache_key_holds_the_options_and_a_plain_start_keeps_its_key(tmp_path):
    art = tmp_path / "m.bin"
    art.write_bytes(b"x" * 100)
    plain = cache_key(Fast, str(art))
    assert "options" not in plain and cache_key(Fast, str(art), {}) == plain  # the key every earlier start used
    assert cache_key(Fast, str(art), {"n_ctx": "4096"}) == {**plain, "options": {"n_ctx": "4096"}}
    assert cache_key(Fast, str(art), {"b": "1", "a": "2"}) == cache_key(Fast, str(art), {"a": "2", "b": "1"})


class Picky(_Fake):
    """Fails to load with an option it does not know, as an engine does."""

    name = "picky"
    step_seconds = 0.0005

    def load(self, artifact, name):
        if self.config.options:
            raise ConfigError(f"Unknown option '{next(iter(self.config.options))}' for engine picky.")
        return super().load(artifact, name)


class _OptCand(_Cand):
    def __init__(self, cls, artifact, options):
        super().__init__(cls, artifact)
        self.config = ServerConfig(options=options)

    async def open(self, bench):
        engine = self.cls(self.config)
        engine.load(self.artifact, "m")
        self.engine = engine
        if bench is None:
            return 0.0, None
        from octo.runtime.benchmark import micro_benchmark

        return 0.0, micro_benchmark(engine, *bench)


def test_a_failure_under_options_never_stands_for_a_plain_start(tmp_path, monkeypatch):
    monkeypatch.setenv("OCTO_HOME", str(tmp_path))
    art = tmp_path / "m.bin"
    art.write_bytes(b"x" * 100)

    def run(options):
        cands = {"picky": _OptCand(Picky, str(art), options), "fast": _OptCand(Fast, str(art), options)}
        return asyncio.run(select(cands, seconds=0.3, say=lambda m: None))[2]

    first = run({"only_fast_knows": "1"})
    assert first["picky"]["error"].startswith("load failed: Unknown option")
    plain = run({})  # measured, not the failure cached under the options
    assert not plain["picky"].get("error") and not plain["picky"]["cached"], plain["picky"]
    again = run({"only_fast_knows": "1"})  # the failure under the options is still the cached verdict for them
    assert again["picky"]["cached"] and again["picky"]["error"].startswith("load failed")


def test_the_demo_serves_with_an_option_of_one_engine_only(tmp_path):
    """``-o threads=1`` is an option of ONNX Runtime alone: llama.cpp and MLX run without it, nothing fails, and the
    next start without the option finds no failure cached for them."""
    env = {"OCTO_BENCH_DIR": str(tmp_path / "bench")}
    with run_octo("demo", "--bench-when-idle", "-o", "threads=1", env=env) as server:
        engines = server.get_json("/v1/engines")
        ok = server.openai().chat.completions.create(model="demo", max_tokens=4, extra_body={"ignore_eos": True},
                                                      messages=[{"role": "user", "content": "hi"}])
        log = server.log()
    assert "-o threads is an option of onnx only: llamacpp, mlx run without it" in log, log[-3000:]
    assert "FAILED" not in log and ok.choices[0].finish_reason == "length"
    assert engines["active"] == "llamacpp", engines["selection"]
    with run_octo("demo", "--bench-when-idle", env=env) as server:
        rows = {r["name"]: r for r in server.get_json("/v1/engines")["data"]}
        log = server.log()
    assert "FAILED" not in log and not any((r.get("benchmark") or {}).get("error") for r in rows.values()), log[-3000:]
