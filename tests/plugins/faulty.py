"""Fault-injection engines for the test suite (loaded with ``--plugins-dir tests/plugins``).

``faulty`` behaves like echo (it repeats the last user message) and fails on purpose. Words in a prompt choose a
fault for that sequence, once it has generated ``after`` tokens: HANG (its step never returns), STEPFAIL (the step
raises: every sequence in it fails), SEQFAIL (the step returns an exception for this sequence alone), BYTESFAIL
(``token_bytes`` raises when the word itself is generated), CRASH (the process dies, with ``crash_in=step``). Options:
  -o crash_in=none|load|warmup|step   where it dies (default none; "step" only for prompts that contain CRASH)
  -o how=segv|abort|kill|exit          how: SIGSEGV, SIGABRT (abort()), SIGKILL (as the OOM killer does), exit(3)
  -o after=N                           in "step": after N generated tokens (default 2)
  -o safe=true                         never crash: its fallback configuration (what a crash at load or warm-up
                                       retries with, like llama.cpp's repack=false)
  -o token_delay_ms=N                  as echo
``crashy`` dies of SIGSEGV in its first decode step and declares no fallback (a selection candidate that crashes);
``hangy`` never returns from a step (one that hangs); ``steady`` never crashes. All three claim GGUF files, so a
GGUF path makes them candidates.
"""

from __future__ import annotations

import os
import signal
import time

from octo.engines.echo import EchoEngine

from octo.engine import Task
from octo.errors import ConfigError
from octo.hookspecs import hookimpl

_FAULT_WORDS = frozenset({"HANG", "STEPFAIL", "SEQFAIL", "BYTESFAIL"})
_OWN = {"crash_in": ("none", "load", "warmup", "step"), "how": ("segv", "abort", "kill", "exit"), "after": None,
        "safe": ("true", "false")}


def die(how: str) -> None:
    if how == "abort":
        os.abort()
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSEGV)
    time.sleep(5)  # the signal is delivered before this ends


class FaultyEngine(EchoEngine):
    name = "faulty"
    isolation = "process"
    fallbacks = (({"safe": "true"}, "the faulty engine's unsafe mode crashed"),)

    def __init__(self, config=None) -> None:
        options = dict((config.options if config else {}) or {})
        own = {k: options.pop(k) for k in list(options) if k in _OWN}
        for key, value in own.items():
            if _OWN[key] is not None and value not in _OWN[key]:
                raise ConfigError(f"faulty: {key} must be one of {', '.join(_OWN[key])}", param=key)
        if config is not None:
            config.options = options
        super().__init__(config)
        safe = own.get("safe") == "true"
        self.crash_in = "none" if safe else own.get("crash_in", "none")
        self.how = own.get("how", "segv")
        self.after = int(own.get("after", "2"))
        self.steps = 0

    def load(self, artifact, name):
        if self.crash_in == "load":
            die(self.how)
        return super().load(artifact, name)

    def add_sequence(self, seq) -> None:
        super().add_sequence(seq)
        words = {self._pieces[t].strip() for t in seq.tokens}
        seq.slot["crash"] = "CRASH" in words
        seq.slot["faults"] = words & _FAULT_WORDS

    def step(self, feeds):
        self.steps += 1
        if self.crash_in == "warmup":
            die(self.how)
        late = [f for f in feeds if f.seq.slot["emitted"] >= self.after]
        if self.crash_in == "step" and any(f.seq.slot["crash"] for f in late):
            die(self.how)
        if any("HANG" in f.seq.slot["faults"] for f in late):
            time.sleep(3600)  # a wedged native call: the watchdog must notice
        if any("STEPFAIL" in f.seq.slot["faults"] for f in late):
            raise RuntimeError("the faulty engine failed this step")
        out = super().step(feeds)
        return [RuntimeError("the faulty engine failed this sequence")
                if tok is not None and "SEQFAIL" in f.seq.slot["faults"] and f.seq.slot["emitted"] > self.after
                else tok for f, tok in zip(feeds, out, strict=True)]

    def token_bytes(self, token):
        if self._pieces[token].strip() == "BYTESFAIL":
            raise ValueError("the faulty engine cannot spell this token")
        return super().token_bytes(token)


class CrashyEngine(FaultyEngine):
    name = "crashy"
    formats = frozenset({"gguf"})
    tasks = frozenset({Task.CHAT, Task.COMPLETION})
    fallbacks = ()

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.crash_in = "warmup"


class HangyEngine(FaultyEngine):
    """Never returns from a step: a selection candidate that hangs past its budget."""

    name = "hangy"
    formats = frozenset({"gguf"})
    tasks = frozenset({Task.CHAT, Task.COMPLETION})
    fallbacks = ()

    def step(self, feeds):
        time.sleep(3600)


class SteadyEngine(FaultyEngine):
    name = "steady"
    formats = frozenset({"gguf"})
    tasks = frozenset({Task.CHAT, Task.COMPLETION})


@hookimpl
def register_engines(register):
    register(FaultyEngine)
    register(CrashyEngine)
    register(HangyEngine)
    register(SteadyEngine)
