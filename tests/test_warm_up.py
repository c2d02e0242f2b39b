"""The worker's warm-up after a load: the least computation that runs both kinds of engine step (a batch of prompt
tokens, then one decode token), so that a crash in either happens while a fallback configuration can take over."""

from __future__ import annotations

from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig, Task
from octo.runtime.worker import warm_up


class Recording(EchoEngine):
    def __init__(self) -> None:
        super().__init__(EngineConfig())
        self.steps: list[list[tuple[int, bool]]] = []
        self.added = self.removed = 0

    def add_sequence(self, seq) -> None:
        self.added += 1
        super().add_sequence(seq)

    def remove_sequence(self, seq) -> None:
        self.removed += 1
        super().remove_sequence(seq)

    def step(self, feeds):
        self.steps.append([(len(f.tokens), f.sample) for f in feeds])
        return super().step(feeds)


def test_the_warm_up_runs_a_two_token_batch_then_one_decode_step_and_frees_its_sequence():
    engine = Recording()
    engine.load("", "m")
    warm_up(engine)
    assert engine.steps == [[(2, True)], [(1, True)]]
    assert engine.added == engine.removed == 1


def test_an_embedding_model_is_warmed_up_with_one_embedding():
    class Embedder(Recording):
        tasks = frozenset({Task.EMBEDDINGS})

        def embed(self, texts):
            self.embedded = list(texts)
            return super().embed(texts)

    engine = Embedder()
    engine.load("", "m")
    engine.info.tasks = frozenset({Task.EMBEDDINGS})
    warm_up(engine)
    assert engine.steps == [] and engine.embedded == ["warm up"]
