"""Text <-> token ids for the frontend (torch-free).

A model directory's ``tokenizer.json`` (Hugging Face ``tokenizers``) is used when present;
otherwise a byte-level fallback maps each UTF-8 byte to the id of the same value (needs a
vocabulary of at least 256).  Chat prompts are rendered with Jinja from, in this order: the
template given to ``serve --chat-template`` (as vLLM), the model directory's
``chat_template.jinja`` or ``chat_template`` in ``tokenizer_config.json``; without any, a
ChatML-style text template.  Templates run in Jinja's sandbox with what transformers'
``apply_chat_template`` gives them, so that a prompt is the text the model was trained on:
``raise_exception`` (a template's refusal is the client's error: HTTP 400), ``strftime_now``,
a ``tojson`` that neither sorts keys nor escapes HTML (Jinja's own does both: tool schemas
would render otherwise), ``{% break %}`` / ``{% continue %}`` and ``{% generation %}`` blocks
(rendered as their body).
"""
from __future__ import annotations

import json
import os


class TemplateError(ValueError):
    """The chat template refused the messages (or failed on them)."""


def compile_template(text: str):
    """A Jinja chat template, compiled in the sandbox as transformers compiles it (module doc);
    ``ValueError`` if it does not parse."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %} ... {% endgeneration %}``: marks the assistant's part for training
        masks in transformers; rendered as its body here."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(msg):
        raise TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None


class Codec:
    def __init__(self, model_dir: str | None, vocab_size: int, chat_template: str | None = None) -> None:
        self.tok = None
        self.template = None
        self.special: dict = {}
        d = model_dir if model_dir and os.path.isdir(model_dir) else None
        path = os.path.join(d, "tokenizer.json") if d else None
        if path and os.path.exists(path):
            from tokenizers import Tokenizer
            self.tok = Tokenizer.from_file(path)
            self.kind = "tokenizer.json"
        else:
            if vocab_size < 256:
                raise ValueError(f"no tokenizer.json and vocab_size {vocab_size} < 256: byte fallback impossible")
            self.kind = "bytes"
        cfg = os.path.join(d, "tokenizer_config.json") if d else None
        if cfg and os.path.exists(cfg):
            with open(cfg) as f:
                tc = json.load(f)
            self.template = tc.get("chat_template")
            if isinstance(self.template, list):          # named templates: the default one
                self.template = next((t.get("template") for t in self.template if t.get("name") == "default"), None)
            self.special = {k: tc[k] for k in ("bos_token", "eos_token") if isinstance(tc.get(k), str)}
        jinja_file = os.path.join(d, "chat_template.jinja") if d else None
        if jinja_file and os.path.exists(jinja_file):     # newer transformers save the template here
            with open(jinja_file) as f:
                self.template = f.read()
        if chat_template is not None:
            self.template = chat_template
        self._compiled = compile_template(self.template) if self.template else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.tok is not None:
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tok is not None:
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        """The id of the token that is exactly ``text`` (an added token such as ``</think>``), or None."""
        return self.tok.token_to_id(text) if self.tok is not None else None

    def token_text(self, tid: int) -> str:
        """One token as text, special tokens included (a partial UTF-8 sequence shows as U+FFFD)."""
        return self.decode([tid], skip_special_tokens=False)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True, continue_final: bool = False,
             **kwargs) -> str:
        """Render checked messages (``content``: a string or None) to the prompt text.
        ``continue_final``: the text ends with the last message's content, the rest of its turn
        cut, so that the model continues that message (transformers' and vLLM's
        ``continue_final_message``)."""
        text = self._render(messages, add_generation_prompt, **kwargs)
        if not continue_final:
            return text
        final = (messages[-1].get("content") or "").strip()
        if not final or final not in text:
            raise TemplateError("continue_final_message: the last message's content does not appear in the "
                                "rendered chat (an empty message, or a template that rewrites it)")
        return text[:text.rindex(final) + len(final)]

    def _render(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
        if self._compiled is not None:
            try:
                return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **{**self.special, **kwargs})
            except TemplateError:
                raise
            except Exception as e:      # a template failing on these messages: the client's request
                raise TemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class IncrementalText:
    """The text of a token list that only grows (a stream's), decoded a window of new tokens at a
    time instead of whole at every step, which cost a stream the square of its length
    (``python -m bench stream_text``: 2.7 s of the frontend's one thread over an 8 000-token
    reply, against 18 ms).  The window is decoded with the tokens before it as context,
    as vLLM and TGI do, so that decoders that treat a first token apart (SentencePiece's leading
    space) join correctly.  ``update(ids)`` is the text of ``ids`` but for a tail still undecided
    (a character whose bytes are not all in: held back until they are); it is a prefix of
    ``Codec.decode(ids)`` and equals it once that tail is whole.  A list that shrinks (never,
    from the frontend) starts it over."""

    def __init__(self, codec: Codec, skip_special_tokens: bool = True) -> None:
        self.codec, self.skip = codec, skip_special_tokens
        self.text, self.prefix, self.read = "", 0, 0

    def update(self, ids: list[int]) -> str:
        if len(ids) < self.read:
            self.text, self.prefix, self.read = "", 0, 0
        if len(ids) > self.read:
            before = self.codec.decode(ids[self.prefix:self.read], self.skip)
            after = self.codec.decode(ids[self.prefix:], self.skip)
            if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(ids)
            elif len(after) == len(before) and after == before:
                self.read = len(ids)          # tokens with no text (special ones skipped): nothing held
        return self.text

