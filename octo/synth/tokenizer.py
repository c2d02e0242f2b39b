"""A small byte-level BPE tokenizer with exactly Qwen2's pipeline, trained locally on a fixed-seed corpus.

Every synthetic model (all engine formats) uses this tokenizer, so they all encode text identically. The
trained ``tokenizer.json`` is cached once under ``synth_dir()/tokenizer-v1`` and copied into each built
model.
"""

from __future__ import annotations

import functools
import random
import shutil
from pathlib import Path

from octo.paths import synth_dir
from octo.synth.spec import TOKENIZER_VOCAB

VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# transformers' models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX (rebuilt by transformers 5 for qwen2).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5's ChatML template without tool support.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud."
    " You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first)'
    ' or (message.role == "assistant") %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_WORDS = """
the of and to in is was for on that with as by at from it be this are or an which his have not has but
they were had one all their can more been its also other when there who new after first into time two only
some would about than over these may most such then them years many so could each under made well where
between those world city year state during three people while through before both because part system day
water house light river road market school music story science history model language word number point
work life city power field line place music group family order report market question answer system data
engine speed token memory cache server request response stream batch queue model layer weight value key
small large quick slow bright dark early late simple clear strong gentle quiet happy careful curious
run walk read write build test serve measure compare choose learn teach open close start stop begin end
morning evening winter summer spring autumn north south east west garden forest mountain ocean island
window door table chair paper letter window kitchen station harbor bridge tower village valley meadow
teacher doctor farmer painter writer sailor builder engineer student reader listener traveler neighbor
because although however therefore perhaps almost always never often sometimes usually rarely together
""".split()

_PARAGRAPHS = [
    "The old lighthouse stood at the edge of the harbor, and every evening the keeper climbed the "
    "narrow stairs to light the lamp. Ships passing in the dark could see it from far away, and they "
    "knew where the rocks were.",
    "A good engine answers quickly, keeps its memory small, and never forgets a request that is still "
    "waiting. When many people ask at once, it serves them in turns, a few tokens at a time, so that "
    "nobody waits too long.",
    "In the spring the river rose over its banks, and the farmers moved their animals to the hills. By "
    "summer the water had gone down again, leaving rich dark soil in the fields where wheat and barley "
    "grew tall.",
    "She opened the letter carefully, read it twice, and then laughed out loud. \"We're going to the "
    'mountains!" she said. "They\'ve found a house for us, near the lake, with a garden and three old '
    'apple trees."',
    "Numbers can be written in many ways: 42, 3.14159, 1,000,000, 2024-05-17, 0x1F, and 7e-3. Prices "
    "like $19.99 or 12.50 EUR appear in shops; times like 09:30 or 18:45 appear on timetables at every "
    "station.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))\n",
    '{"model": "demo", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}\n',
    "Café, naïve, résumé, façade, Zürich, São Paulo, Kraków, Ångström. Привет, мир. Γειά σου κόσμε. "
    "你好，世界。こんにちは。안녕하세요. مرحبا بالعالم. 🙂 🚀 👍🏽 ✨",
]


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    onsets = "b c d f g h j k l m n p r s t v w z br cl dr fl gr pl st tr sh ch th".split()
    vowels = "a e i o u ai ea ou io".split()
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng"]
    return [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(n)
    ]


def corpus(seed: int = 0, n_sentences: int = 12000) -> list[str]:
    """A deterministic training corpus: fixed paragraphs plus seeded sentences of real and invented words."""
    rng = random.Random(seed)
    invented = _pseudo_words(rng, 2000)
    texts = list(_PARAGRAPHS) * 50
    punct = [".", ".", ".", ",", "!", "?", ";", ":"]
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS if rng.random() < 0.6 else invented) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.5:
            words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sep = "\n" if rng.random() < 0.15 else " "
        texts.append(" ".join(words) + rng.choice(punct) + sep)
    rng.shuffle(texts)
    return texts


def train(seed: int = 0):
    """Train the tokenizer (deterministic; < 1 s). Returns a ``tokenizers.Tokenizer``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() > TOKENIZER_VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > {TOKENIZER_VOCAB}")
    return tok


def tokenizer_path() -> Path:
    """The cached ``tokenizer.json`` shared by all synthetic models (trained on first use)."""
    from octo.atomic import build_file

    path = synth_dir() / f"tokenizer-v{VERSION}" / "tokenizer.json"
    return build_file(path, lambda tmp: train().save(str(tmp)))


@functools.cache
def _load(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def load_tokenizer():
    """The shared ``tokenizers.Tokenizer``."""
    return _load(str(tokenizer_path()))


def special_ids() -> dict[str, int]:
    tok = load_tokenizer()
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def write_tokenizer_files(folder: Path, model_max_length: int) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``folder``."""
    import json

    shutil.copyfile(tokenizer_path(), folder / "tokenizer.json")
    ids = special_ids()
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    }
    special_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": {
            "content": "<|im_end|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "pad_token": {
            "content": "<|endoftext|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return ids
