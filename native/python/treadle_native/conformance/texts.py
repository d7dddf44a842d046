"""Message text for the conformance corpus: fixed pools and a seeded, flavoured text source.

A *flavour* is the text property a case stresses: `plain`, `unicode`, `empty`, `long` or
`whitespace`. `TextSource` hands out strings of one flavour and guarantees that the first
string it returns has the flavour, so every case built from it really carries that property.

No string here contains a control token of any target (`<|im_end|>`, `<｜User｜>`,
`<|eot_id|>`, ...); a few contain near misses (an unclosed `<|im_start`) on purpose.
Reasoning tags (`<think>`) are added by the corpus where a case needs them, not here.
"""

from __future__ import annotations

import random

FLAVOURS = ("plain", "unicode", "empty", "long", "whitespace")

PLAIN = (
    "Hello!",
    "What is the capital of France?",
    "The capital of France is Paris.",
    "Can you explain how a hash map works, step by step?",
    "Write a haiku about the sea.",
    "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time.",
    "Sure. A hash map stores key-value pairs in buckets chosen by hashing the key.",
    "```python\ndef add(a, b):\n    return a + b\n```",
    "1. first item\n2. second item\n- a bullet with **bold** and _italics_",
    "Use {{ name }} and {% if x %}y{% endif %} in a Jinja template; {# not a comment #}",
    "<b>bold</b> &amp; <script>alert('x')</script> <div class=\"a\">x</div>",
    '{"key": "value", "numbers": [1, 2.5, null], "nested": {"ok": true}}',
    "Near misses of control tokens: <|im_start and im_end|>, <| eot_id |>, <｜User and </ think>.",
    "Windows path C:\\Users\\me\\new\\table and a literal backslash-n: \\n",
    "She said \"hi\" and then 'bye'.",
    "Numbers: 3.14159 2718281828 1e-05 -0.0 1,000,000 0x1F 1_000",
    "Visit https://example.com/a?b=c&d=e#frag or mail someone@example.org.",
    "Ends with a backslash \\",
    "Tabs\tinside\ttext and a\u00a0no-break space.",
    "OK",
    "Thanks, that helps a lot.",
    "Let me check the numbers again: 17 * 23 = 391.",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name;",
    "$ ls -la | grep '.py' > out.txt 2>&1",
    "It'S THE dog's bone; I'VE seen it, we'll see, they'd know.",
    "old mac\rline breaks\rhere",
)

UNICODE = (
    "你好，世界！今天天气怎么样？",
    "日本語のテキスト：こんにちは。カタカナ、ひらがな、漢字。",
    "한국어 문장입니다. 반갑습니다!",
    "Emoji: 😀🎉🚀 family 👨\u200d👩\u200d👧\u200d👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "العربية: مرحبا بالعالم، كيف حالك؟",
    "עברית: שלום עולם",
    "Mixed direction: abc \u200fשלום\u200e def \u202eevil\u202c done",
    "Combining marks: e\u0301 a\u0300 n\u0303 Z\u0351\u0334a\u0362l\u0316g\u0353o\u0338",
    "Decomposed Cafe\u0301 versus composed Café",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom\u2060joiner",
    "Ελληνικά, Русский язык, ไทย, हिन्दी",
    "Math: ∑∫√∞ ≤ ≥ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and fullwidth ＡＢＣ１２３",
    "Replacement \ufffd, private use \ue000, variation selectors ☺\ufe0f ✌\ufe0e",
    "Astral plane: 𐍈 𝄞 🀄 𓀀",
    "Lookalikes of control text: ▁ (U+2581) and ｜ (fullwidth bar)",
    "Ångström, naïve, façade, Œuvre, straße",
)

# Whitespace that wraps text, and whole whitespace-only strings. \x1c-\x1f are whitespace
# for Python's str.strip (so for Jinja's `trim`) but not for Rust's char::is_whitespace.
PADDING = (
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "\r",
    " \n\t ",
    "\u00a0",
    "\u3000",
    "\x0b\x0c",
    "\x1c\x1d\x1e\x1f",
    "\u2028",
    "\x85",
)
WHITESPACE_ONLY = (" ", "\n", "\n\n\n", "\t", "\r\n", "   \t\n", "\u3000", "\x1f", " \x85 ")
INNER_WHITESPACE = (
    "line one\r\nline two\r\n",
    "a  b   c    d",
    "trailing newlines\n\n\n",
    "\n\nleading newlines",
    "indented\n    code\n\tand tab",
    "mixed \t \n \r\n end",
)

CODE_LINE = (
    "def f{i}(x):\n    '''Doc {i}.'''\n    return x * {i} + {{'k': [{i}, {i}.5]}}\n\n",
    "for (int i = 0; i < {i}; ++i) {{ total += a[i] * 0.{i}; }}\n",
    "    if value_{i} is not None and value_{i} >= {i}:\n        yield value_{i}\n",
)


class TextSource:
    """Strings of one flavour; the first string returned always has the flavour."""

    def __init__(self, rng: random.Random, flavour: str) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"unknown flavour {flavour!r}")
        self.rng = rng
        self.flavour = flavour
        self._first = True

    def text(self) -> str:
        """A message text of this source's flavour."""
        first, self._first = self._first, False
        f = self.flavour
        if f == "unicode":
            return self._unicode()
        if f == "empty":
            return "" if first or self.rng.random() < 0.4 else self.plain()
        if f == "long":
            return long_text(self.rng) if first or self.rng.random() < 0.25 else self.plain()
        if f == "whitespace":
            return self._whitespace() if first or self.rng.random() < 0.6 else self.plain()
        return self.plain()

    def short(self) -> str:
        """A short text of this flavour (tool argument strings); never long."""
        if self.flavour == "long":
            return self.plain()
        return self.text()

    def plain(self) -> str:
        return self.rng.choice(PLAIN)

    def _unicode(self) -> str:
        parts = self.rng.sample(UNICODE, self.rng.randint(1, 3))
        if self.rng.random() < 0.3:
            parts.append(self.plain())
        return self.rng.choice((" ", "\n", "")).join(parts)

    def _whitespace(self) -> str:
        r = self.rng.random()
        if r < 0.3:
            return self.rng.choice(WHITESPACE_ONLY)
        if r < 0.5:
            return self.rng.choice(INNER_WHITESPACE)
        return self.rng.choice(PADDING) + self.plain() + self.rng.choice(PADDING)


def long_text(rng: random.Random, min_chars: int = 2500, max_chars: int = 8000) -> str:
    """Several thousand characters of one of a few shapes (prose, code, digits, runs, CJK)."""
    size = rng.randint(min_chars, max_chars)
    shape = rng.choice(("prose", "code", "digits", "run", "cjk", "lines"))
    if shape == "run":
        unit = rng.choice(("=", " ", "ab", "-\n", "\t", "🙂"))
        return (unit * size)[:size] if len(unit) == 1 else unit * (size // len(unit))
    parts: list[str] = []
    total = 0
    i = 0
    while total < size:
        if shape == "prose":
            piece = rng.choice(PLAIN) + " "
        elif shape == "code":
            piece = rng.choice(CODE_LINE).format(i=i)
        elif shape == "digits":
            piece = str(rng.randrange(10**11, 10**12))
        elif shape == "cjk":
            piece = rng.choice(UNICODE[:3]) + "\n"
        else:
            piece = f"{i:05d}: {rng.choice(PLAIN)}\n"
        parts.append(piece)
        total += len(piece)
        i += 1
    return "".join(parts)
