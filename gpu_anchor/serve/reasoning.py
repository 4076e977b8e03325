"""Reasoning in a chat reply (torch-free): the ``<think> ... </think>`` part that Qwen3, QwQ
and DeepSeek-R1 write before their answer, returned apart from the answer (vLLM's
``--reasoning-parser qwen3`` / ``deepseek_r1``).

``split(text, final, opened)`` is ``(reasoning, content)``; ``opened``: the prompt itself
opened the reasoning (its generation prompt ends with ``<think>``, as DeepSeek-R1's and newer
Qwen templates write it).  The contract:

- **reasoning**: from a ``<think>`` at the start of the reply (after blanks), or from the
  start when ``opened``, up to ``</think>``; a reply that never closes it (cut by
  ``max_tokens``) is all reasoning.
- **content**: what follows ``</think>``; or the whole reply when it does not start with
  ``<think>`` (e.g. Qwen3 with ``enable_thinking: false``, whose template closes an empty
  reasoning in the prompt).
- **Monotone**, as ``tool_calls.split``: for any text ``t`` and longer ``t + u``, both parts
  of ``split(t, False)`` are prefixes of ``split(t + u, final)``'s.  What is undecided (blanks
  or a ``<think`` being written at the start, a ``</think`` being written) is held back; so a
  stream sends the differences, and they add up to the reply that is not streamed.
"""
from __future__ import annotations

from .tool_calls import partial_tag

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")     # --reasoning-parser values: the same tags, the same rules


def opened(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open reasoning (its last tag is ``<think>``)."""
    return prompt_text.rstrip().endswith(START)


def split(text: str, final: bool, opened: bool = False) -> tuple[str, str]:
    """``text`` (a reply so far; ``final``: all of it) as ``(reasoning, content)`` (module doc)."""
    if not opened:
        head = text.lstrip()
        if head.startswith(START):
            text = head[len(START):]
        elif not final and START.startswith(head):      # blanks, or the tag being written
            return "", ""
        else:
            return "", text
    i = text.find(END)
    if i < 0:
        return (text if final else text[:len(text) - partial_tag(text, END)]), ""
    return text[:i], text[i + len(END):]
