"""Fault-injection engines for the test suite (loaded with ``--plugins-dir tests/plugins``).

``faulty`` behaves like echo (it repeats the last user message) and fails on purpose. Words in a prompt choose a
fault for that sequence, once it has generated ``after`` tokens: HANG (its step never returns), STEPFAIL (the step
raises before it feeds anything), POISON (the step feeds and samples every sequence, then raises: what it did must be
undone), SEQFAIL (the step returns an exception for this sequence alone), BYTESFAIL
(``token_bytes`` raises when the word itself is generated), CRASH (the process dies, with ``crash_in=step``). Options:
  -o crash_in=none|load|warmup|step   where it dies (default none; "step" only for prompts that contain CRASH)
  -o how=segv|abort|kill|exit          how: SIGSEGV, SIGABRT (abort()), SIGKILL (as the OOM killer does), exit(3)
  -o after=N                           in "step": after N generated tokens (default 2)
  -o safe=true                         never crash: its fallback configuration (what a crash at load or warm-up
                                       retries with, like llama.cpp's repack=false)
  -o token_delay_ms=N                  as echo
  -o rollback=false                    declare no ``kv_rollback`` (a step that raises fails all its sequences)
Faults of the other engine methods (words in the prompt, or in an embeddings input):
  TOKFAIL TOKNONE TOKNEG TOKSLOW   ``tokenize`` raises, returns None, returns a negative id, takes ``slow_s`` seconds
  RENDERFAIL RENDERNONE            ``render_chat`` raises, returns None
  ADDFAIL REMOVEFAIL REMOVEHANG    ``add_sequence`` raises; ``remove_sequence`` raises, or takes ``slow_s`` seconds
  NEGTOK BIGTOK STRTOK EMPTYTOK    ``step`` returns, for this sequence: -1, an id past the vocabulary, a str, []
  NOADVANCE                        ``step`` does not advance ``n_cached`` of this sequence
  KVFULL                           ``step`` raises KVCacheFull (though it has no shared KV pool)
  LPBAD                            ``step`` answers logprobs that are not a (logprob, top) pair
  SAVEFAIL SAVEBAD FREEFAIL        ``kv_save`` raises, returns a str; ``kv_free`` of its handle raises
  SAVEWRONG SAVENEG                ``kv_save`` returns a handle for other tokens, of a negative size
  RESTOREOVER                      ``kv_restore`` claims more cached tokens than it was asked for
  EMBEDFAIL EMBEDNAN EMBEDDIM EMBEDFEW EMBEDNONE   ``embed`` raises, returns NaN, a wrong dimension, too few vectors,
                                   None
  -o kv_room=fail                  ``kv_room`` raises
  -o info=bad                      ``load`` gives a ModelInfo with n_ctx 0
  -o slow_s=N                      how long TOKSLOW and REMOVEHANG take (default 3600)
  -o load_s=N                      ``load`` takes N seconds (default 0)
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
from octo.errors import ConfigError, KVCacheFull
from octo.hookspecs import hookimpl

_FAULT_WORDS = frozenset({"HANG", "STEPFAIL", "POISON", "SEQFAIL", "BYTESFAIL", "ADDFAIL", "REMOVEFAIL", "REMOVEHANG",
                          "NEGTOK", "BIGTOK", "STRTOK", "EMPTYTOK", "NOADVANCE", "KVFULL", "LPBAD", "SAVEFAIL",
                          "SAVEBAD", "SAVEWRONG", "SAVENEG", "FREEFAIL", "RESTOREOVER"})
_BAD_TOKENS = {"NEGTOK": -1, "BIGTOK": 10**9, "STRTOK": "x", "EMPTYTOK": []}
_OWN = {"crash_in": ("none", "load", "warmup", "step"), "how": ("segv", "abort", "kill", "exit"), "after": None,
        "safe": ("true", "false"), "kv_room": ("ok", "fail"), "info": ("ok", "bad"), "slow_s": None,
        "load_s": None, "rollback": ("true", "false")}


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
        self.room_fails = own.get("kv_room") == "fail"
        self.bad_info = own.get("info") == "bad"
        self.slow_s = float(own.get("slow_s", "3600"))
        self.load_s = float(own.get("load_s", "0"))  # a slow load (seconds)
        if own.get("rollback") == "false":
            self.supports_rollback = False
        self.steps = 0

    def load(self, artifact, name):
        if self.crash_in == "load":
            die(self.how)
        time.sleep(self.load_s)
        info = super().load(artifact, name)
        if self.bad_info:
            info.n_ctx = 0
        return info

    # -- faults of the other methods -----------------------------------------------------------------
    def tokenize(self, text, special=True):
        if "TOKFAIL" in text:
            raise RuntimeError("the faulty engine cannot tokenize this")
        if "TOKSLOW" in text:
            time.sleep(self.slow_s)
        tokens = super().tokenize(text, special)
        if "TOKNONE" in text:
            return None
        return [-3, *tokens] if "TOKNEG" in text else tokens

    def render_chat(self, messages, add_generation_prompt=True, tools=None):
        text = " ".join(str(m.get("content")) for m in messages)
        if "RENDERFAIL" in text:
            raise RuntimeError("the faulty engine cannot render this chat")
        if "RENDERNONE" in text:
            return None
        return super().render_chat(messages, add_generation_prompt, tools)

    def embed(self, texts):
        text = " ".join(texts)
        if "EMBEDFAIL" in text:
            raise RuntimeError("the faulty engine cannot embed this")
        if "EMBEDNONE" in text:
            return None
        out = super().embed(texts)
        if "EMBEDNAN" in text:
            out.vectors[0][0] = float("nan")
        if "EMBEDDIM" in text:
            out.vectors[-1] = out.vectors[-1][:3]
        if "EMBEDFEW" in text:
            out.vectors.pop()
        return out

    def kv_room(self):
        if self.room_fails:
            raise RuntimeError("the faulty engine cannot count its KV cells")
        return super().kv_room()

    def _faults(self, seq) -> set:
        return seq.slot["faults"] if isinstance(seq.slot, dict) else set()

    def add_sequence(self, seq) -> None:
        super().add_sequence(seq)
        words = {self._pieces[t].strip() for t in seq.tokens}
        seq.slot["crash"] = "CRASH" in words
        seq.slot["faults"] = words & _FAULT_WORDS
        if "ADDFAIL" in words:
            raise RuntimeError("the faulty engine cannot add this sequence")

    def remove_sequence(self, seq) -> None:
        faults = self._faults(seq)
        super().remove_sequence(seq)
        if "REMOVEHANG" in faults:
            time.sleep(self.slow_s)
        if "REMOVEFAIL" in faults:
            raise RuntimeError("the faulty engine cannot remove this sequence")

    def kv_save(self, seq):
        faults = self._faults(seq)
        if "SAVEFAIL" in faults:
            raise RuntimeError("the faulty engine cannot save this KV")
        if "SAVEBAD" in faults:
            return "not a handle"
        handle = super().kv_save(seq)
        if "SAVEWRONG" in faults:  # KV it claims holds other tokens (the index would serve it to other prompts)
            handle.tokens = (handle.tokens[0] + 1, *handle.tokens[1:])
        if "SAVENEG" in faults:  # a size that would make the index's byte count negative (it never evicts again)
            handle.nbytes = -2**40
        if "FREEFAIL" in faults:
            handle.data = ("FREEFAIL", handle.data)
        return handle

    def kv_restore(self, seq, handle, n_tokens):
        if handle.data and isinstance(handle.data[0], str):
            raise ValueError("the faulty engine will not restore this")
        super().kv_restore(seq, handle, n_tokens)
        if "RESTOREOVER" in self._faults(seq):
            seq.n_cached = len(seq.tokens) + 5

    def kv_free(self, handle):
        if handle.data and handle.data[0] == "FREEFAIL":
            raise RuntimeError("the faulty engine cannot free this KV")

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
        if any("KVFULL" in f.seq.slot["faults"] for f in late):
            raise KVCacheFull("the faulty engine says its KV is full")
        before = [f.seq.n_cached for f in feeds]
        out = super().step(feeds)
        if any("POISON" in f.seq.slot["faults"] for f in late):  # after every sequence advanced
            raise RuntimeError("the faulty engine was poisoned by a sequence of this step")
        for i, f in enumerate(feeds):
            faults, late = f.seq.slot["faults"], f.seq.slot["emitted"] > self.after
            if "NOADVANCE" in faults:
                f.seq.n_cached = before[i]
            if out[i] is None or not late:
                continue
            if "SEQFAIL" in faults:
                out[i] = RuntimeError("the faulty engine failed this sequence")
            if "LPBAD" in faults and f.logprobs >= 0:
                f.logprob = "not a (logprob, top) pair"
            for word in faults & _BAD_TOKENS.keys():
                out[i] = _BAD_TOKENS[word]
        return out

    def token_bytes(self, token):
        if 0 <= token < len(self._pieces) and self._pieces[token].strip() == "BYTESFAIL":
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
