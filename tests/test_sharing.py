"""In-flight prefix deduplication (octo.scheduler.sharing) on the scripted echo engine: a shared prefix is fed once,
the texts
are those of the requests run without sharing, and a lead that leaves early (cancelled, preempted) leaves its
followers what it computed."""

import asyncio

import pytest
from octo.engines.echo import EchoEngine

from octo.engine import EngineConfig
from octo.scheduler.admission import GenerationRequest, Scheduler
from octo.scheduler.prefix_cache import PrefixCache
from octo.scheduler.sharing import MIN_SHARE, common_prefix

SYSTEM = " ".join(f"tool{i} takes a path and returns the lines" for i in range(60))  # ~480 tokens


class Counting(EchoEngine):
    """Echo that counts every token it is fed and every share."""

    def load(self, artifact: str, name: str):
        self.fed = 0
        self.shares = []
        return super().load(artifact, name)

    def step(self, feeds):
        out = super().step(feeds)
        self.fed += sum(len(f.tokens) for f in feeds)
        return out

    def kv_share(self, src, dst, n_tokens):
        self.shares.append(n_tokens)
        super().kv_share(src, dst, n_tokens)


def engine(**opts) -> Counting:
    e = Counting(EngineConfig(options={k: str(v) for k, v in opts.items()}))
    e.load("x", "m")
    return e


def prompt(e, user: str, system: str = SYSTEM) -> list[int]:
    return e.tokenize(e.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}]))


USERS = ["first question here", "second one about files", "third asks for tests", "fourth wants a diff"]


async def run(dedup: bool, users=USERS, n: int = 1, cache: bool = False, system: str = SYSTEM, **opts):
    e = engine(**opts)
    pc = PrefixCache(1 << 30, e.kv_free) if cache else None
    s = Scheduler(e, max_batch=8, dedup=dedup, cache=pc)
    s.start()
    try:
        tickets = [t for u in users for t in s.submit(GenerationRequest(prompt(e, u, system), max_tokens=12), n=n)]
        results = [await t.result for t in tickets]
        return e, s, results
    finally:
        s.stop()


def test_common_prefix():
    a = list(range(100))
    assert common_prefix(a, a, 1000) == 100
    assert common_prefix(a, a, 40) == 40
    for k in (0, 1, 37, 99):
        b = a[:k] + [-1] + a[k + 1:]
        assert common_prefix(a, b, 1000) == k
    assert common_prefix(a, a[:10], 1000) == 10
    assert common_prefix([], a, 5) == 0


async def test_a_shared_prefix_is_fed_once_and_the_texts_do_not_change():
    e0, s0, plain = await run(dedup=False)
    e1, s1, shared = await run(dedup=True)
    assert [r.text for r in shared] == [r.text for r in plain] == USERS
    n_prefix = common_prefix(prompt(e1, USERS[0]), prompt(e1, USERS[1]), 10**6)
    total = sum(len(prompt(e1, u)) for u in USERS)
    assert e0.fed >= total  # every prompt computed in full
    assert e1.fed <= total - 3 * n_prefix + 4 * 12  # the prefix once (plus the decode tokens)
    assert len(e1.shares) == 3 and all(n == n_prefix for n in e1.shares)
    assert s1.stats()["total_shared_tokens"] == 3 * n_prefix
    assert [r.cached_tokens for r in shared] == [0, n_prefix, n_prefix, n_prefix]


async def test_n_choices_compute_their_prompt_once():
    e, s, results = await run(dedup=True, users=USERS[:1], n=4)
    assert [r.text for r in results] == [USERS[0]] * 4
    n = len(prompt(e, USERS[0]))
    assert e.fed <= n + 3 + 4 * 12  # one prompt; each follower feeds its last prompt token itself
    assert e.shares == [n - 1] * 3


async def test_short_prefixes_are_not_waited_for():
    users = ["alpha beta", "gamma delta"]
    e, s, results = await run(dedup=True, users=users, system="hi")
    assert [r.text for r in results] == users
    assert e.shares == []
    assert common_prefix(prompt(e, users[0], "hi"), prompt(e, users[1], "hi"), 10**6) < MIN_SHARE


async def test_dedup_off_and_with_the_prefix_cache():
    e, s, results = await run(dedup=True, cache=True)
    assert [r.text for r in results] == USERS
    assert s.stats()["prefix_dedup"] is True


async def test_the_lead_cancelled_mid_prefill_leaves_its_followers_what_it_computed():
    e = engine(token_delay_ms=20)
    e.prefill_chunk = 64  # several steps of prefix
    s = Scheduler(e, max_batch=8, step_stretch=0)
    s.start()
    try:
        tickets = [s.submit(GenerationRequest(prompt(e, u), max_tokens=12))[0] for u in USERS]
        lead = tickets[0]
        while lead.seq.n_cached < 128:
            await asyncio.sleep(0.005)
        assert all(t.lead is lead for t in tickets[1:])
        s.abandon(lead)
        results = [await t.result for t in tickets[1:]]
        assert [r.text for r in results] == USERS[1:]
        assert (await lead.result).finish_reason == "cancelled"
        assert e.shares and e.shares[0] >= 128  # what the lead had, handed over before it left
        for _ in range(100):
            if not e._seqs:
                break
            await asyncio.sleep(0.01)
        assert not e._seqs  # every slot freed
    finally:
        s.stop()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_kv_pressure_with_shared_prefixes(mode):
    n = len(prompt(engine(), USERS[0]))
    e = engine(kv_cells=2 * n + 4, n_ctx=n + 40)  # two prompts fit; their replies (5 tokens each) do not
    s = Scheduler(e, max_batch=4, preempt=mode)
    s.start()
    try:
        tickets = [s.submit(GenerationRequest(prompt(e, u), max_tokens=30))[0] for u in USERS]
        results = [await t.result for t in tickets]
        assert [r.text for r in results] == USERS
        assert s.stats()["total_preemptions"] > 0
        assert not e._seqs
    finally:
        s.stop()


def test_a_sequence_with_cached_tokens_follows_only_where_the_engine_can_drop_them():
    """A follower that restored tokens from the prefix cache must drop them before it takes a lead's KV: an engine
    without kv_drop (ONNX Runtime's) leaves it to compute the rest itself, with no failed share logged."""
    from octo.engine import Engine, SamplingParams, Sequence
    from octo.scheduler.sharing import PrefixSharing

    class T:
        def __init__(self, tokens, cached=0):
            self.seq = Sequence(0, tokens, SamplingParams())
            self.seq.n_cached = cached
            self.lead = None

    class NoDrop(EchoEngine):
        kv_drop = Engine.kv_drop

    prompt = list(range(300))
    for cls, follows in ((EchoEngine, True), (NoDrop, False)):
        lead, fresh, restored = T(prompt + [1]), T(prompt + [2]), T(prompt + [3], cached=100)
        active = [lead, fresh, restored]
        s = PrefixSharing(cls(EngineConfig()), active)
        s.find_lead(fresh)
        s.find_lead(restored)
        assert fresh.lead is lead  # nothing to drop: any engine shares
        assert (restored.lead is lead) is follows
