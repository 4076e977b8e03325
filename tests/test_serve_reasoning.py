"""Reasoning apart from the answer (``serve/reasoning.py``, torch-free): Qwen3's and
DeepSeek-R1's ``<think>`` blocks, opened by the reply or by the prompt, closed or cut off; and
the stream's contract, as for tool calls: every prefix's split is a prefix of the whole
reply's, for every way the text can arrive.  Through the server: tests/test_serve_tool_calls.py."""
from __future__ import annotations

import pytest

from gpu_anchor.serve.reasoning import opened, split

CASES = [
    # (reply, opened by the prompt, reasoning, content)
    ("<think>\nweather: a tool\n</think>\n\nIt is sunny.", False, "\nweather: a tool\n", "\n\nIt is sunny."),
    ("\n<think>a</think>b", False, "a", "b"),
    ("It is sunny.", False, "", "It is sunny."),
    ("\n\nIt is sunny.", False, "", "\n\nIt is sunny."),
    ("<thinking is fun", False, "", "<thinking is fun"),
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),     # never closed: all reasoning
    ("<think></think>", False, "", ""),
    ("a plan\n</think>\n\nDone.", True, "a plan\n", "\n\nDone."),              # DeepSeek-R1: <think> in the prompt
    ("a plan, cut", True, "a plan, cut", ""),
    ("x < y </thin", True, "x < y </thin", ""),
]


@pytest.mark.parametrize("text,by_prompt,thought,content", CASES)
def test_split(text, by_prompt, thought, content):
    assert split(text, True, by_prompt) == (thought, content)


@pytest.mark.parametrize("text,by_prompt,thought,content", CASES)
def test_every_prefix_is_a_prefix_of_the_reply(text, by_prompt, thought, content):
    sent = ("", "")
    for k in range(len(text) + 1):
        part = split(text[:k], False, by_prompt)
        for a, b, w in zip(sent, part, (thought, content)):
            assert b.startswith(a) and w.startswith(b), (k, part)
        sent = part


def test_undecided_text_is_held_back():
    assert split("\n<thi", False) == ("", "")
    assert split("<think>abc</th", False) == ("abc", "")
    assert split("<think>abc</th", True) == ("abc</th", "")


def test_opened_by_the_prompt():
    assert opened("<|im_start|>assistant\n<think>\n")
    assert not opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")      # Qwen3, enable_thinking false
    assert not opened("<|im_start|>assistant\n")
