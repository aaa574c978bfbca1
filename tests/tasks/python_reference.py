"""A multiple-choice task on the byte decoder's held-out text (the last tenth of the Python
reference's help topics, which it never trains on): each item a passage's last 96 characters
before a word, the word that follows as the right answer, and three misspellings of it as the
wrong ones (two neighbouring letters swapped, at two places, and one letter replaced), each as
long as the word: what a byte-level model knows is spelling in context. 36 items, the same on
every CPython with the same topics."""

from __future__ import annotations

import random
import re

from qreport_widgets.demo.text import HELD_OUT, text_bytes

ITEMS = 36
CONTEXT = 96


def items() -> list[dict]:
    text = bytes(text_bytes().tolist()).decode("utf-8")
    held = text[int(len(text.encode("utf-8")) * (1 - HELD_OUT)) :]
    words = [m for m in re.finditer(r" ([a-z]{4,12})\b", held)]  # lower-case words, after a space
    draw = random.Random(0)
    picked, seen = [], set()
    for match in draw.sample(words, len(words)):
        start = match.start()
        context = held[start - CONTEXT : start]
        if start < CONTEXT or "\n" in context[-24:] or match.group(1) in seen:
            continue
        seen.add(match.group(1))
        picked.append((context, " " + match.group(1)))
        if len(picked) == ITEMS:
            break
    found = []
    for context, right in picked:
        wrong = misspelt(right, draw)
        choices = [right, *wrong]
        draw.shuffle(choices)
        found.append({"context": context, "choices": choices, "answer": choices.index(right)})
    return found


def misspelt(word: str, draw: random.Random) -> list[str]:
    """Three spellings of `` word`` that differ from it and from each other, each as long."""
    letters = "etaoinshrdlucmfwypvbgk"
    found: list[str] = []
    while len(found) < 3:
        chars = list(word)
        at = draw.randrange(1, len(chars) - 1)
        if len(found) < 2:
            chars[at], chars[at + 1] = chars[at + 1], chars[at]
        else:
            chars[at] = draw.choice(letters)
        spelt = "".join(chars)
        if spelt != word and spelt not in found:
            found.append(spelt)
    return found
