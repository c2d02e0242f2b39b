"""A complete engine plugin, the one docs/engines.md walks through: a byte-level 'model' that answers with its
prompt in capitals. Serve it with `octo serve shout --plugins-dir docs/examples --engine upper`.
tests/test_docs.py runs it through a real server, so the tutorial stays true."""

from octo.engine import Detection, Engine, ModelInfo, Task
from octo.hookspecs import hookimpl
from octo.options import Option, parse_engine_options, positive_int

OPTIONS = {"n_ctx": Option(positive_int, "context length (default 2048)")}
EOS = 0


class UpperEngine(Engine):
    name = "upper"
    tasks = frozenset({Task.COMPLETION})
    formats = frozenset({"any"})  # it needs no artifact: any model name serves (a real engine: {"gguf"}, ...)
    isolation = "thread"  # pure Python: no native code to contain in a worker process

    def __init__(self, config=None):
        super().__init__(config)
        self.opts = parse_engine_options(self.name, OPTIONS, self.config.options)

    @classmethod
    def detect(cls):  # what /v1/engines and `octo engines` say; a missing runtime is Detection(False, why)
        return Detection(True)

    def load(self, artifact, name):  # a real engine imports its runtime here, lazily, and reads the artifact
        self.info = ModelInfo(name=name, n_ctx=self.opts.get("n_ctx", 2048), eos_token_ids=frozenset({EOS}),
                              n_vocab=256)
        return self.info

    def tokenize(self, text, special=True):
        return list(text.encode())

    def token_bytes(self, token):
        return bytes([token]) if token != EOS else b""

    def add_sequence(self, seq):
        seq.slot = {"answer": None}

    def remove_sequence(self, seq):
        seq.slot = None

    def step(self, feeds):
        """One call per scheduler step: append each feed's tokens to its sequence, sample where asked."""
        out = []
        for feed in feeds:
            seq = feed.seq
            seq.n_cached += len(feed.tokens)  # the tokens now 'in the KV'
            if not feed.sample:
                out.append(None)
                continue
            if seq.slot["answer"] is None:  # the first sample: the whole prompt has been fed
                seq.slot["answer"] = bytes(seq.tokens[:seq.n_cached]).upper()
                seq.slot["start"] = seq.n_cached
            done = seq.n_cached - seq.slot["start"]
            answer = seq.slot["answer"]
            out.append(answer[done] if done < len(answer) else EOS)
        return out


@hookimpl
def register_engines(register):
    register(UpperEngine)
