"""Chat templates: conversations rendered as ``transformers``' ``apply_chat_template``
renders them, tokenized, with the mask of the tokens a model trains on.

**Rendering** runs the template's Jinja in transformers' sandbox (trim_blocks,
lstrip_blocks, loop controls, its ``tojson``, ``raise_exception``, ``strftime_now``,
``{% generation %}``), with ``bos_token``, ``eos_token``, ``tools=None`` and
``documents=None``.

**Tokens.** The text the template writes is tokenized with special token strings parsed
into their ids (``<|im_start|>`` -> its id), without BOS/EOS added, as
``apply_chat_template(messages, tokenize=True)``. A special token string inside a
message stays plain text, as ``apply_chat_template(..., sanitize_control_tokens=True)``
does, so no conversation can forge a turn or a stop (the two agree on every
conversation that spells none).

**Targets.** An assistant turn trains on what a generate loop would produce after the
template's generation prompt: from the end of ``render(messages[:i],
add_generation_prompt=True)`` through the first stop token (EOS, or the template's end of
turn such as ``<|im_end|>`` / ``<|eot_id|>``), so the model learns to stop. Characters map
to tokens through the UTF-8 bytes each token spells.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from plugintrain.core.gguf_header import TOKENIZER_KEYS, is_gguf, read_gguf_metadata
from plugintrain.data.assets import resolve_model_path
from plugintrain.data.tokenizers.registry import TOKENIZER_NAMES, get_tokenizer

TRAIN_ON = ("assistant", "completion", "all")
"""Which tokens `ChatEncoder.encode` trains on: every assistant turn, the final one only,
or every token."""

PLAIN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ('system', 'user', 'assistant') %}"
    "{{- raise_exception('the plain template knows the roles system, user and assistant,"
    " not ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{- eos_token }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
"""A template for base models that have none: each turn is ``<|role|>``, a newline, the
text and a newline, and an assistant's text ends with the tokenizer's EOS (so the model
learns to stop). Its markers are plain text, so it works with any vocabulary::

    <|system|>
    You are terse.
    <|user|>
    Hi
    <|assistant|>
    Hello<EOS>
"""

# The private-use characters transformers wraps a message's special token strings in
# (``chat_template_utils._CONTROL_TOKEN_START``/``_END``), so they tokenize as text.
_START, _END = "\U000f0000", "\U000f0001"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


class ChatTemplateError(ValueError):
    """A template that cannot be read, refuses a conversation, or cannot be split into
    turns; the message is one line."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and where it came from.

    Attributes:
        source: The Jinja text.
        origin: Where it came from, for messages (``"GGUF tokenizer.chat_template of
            FILE"``, a file's path, ``"plain"``).
        bos_token: The tokenizer's BOS string, the template's ``bos_token``.
        eos_token: The tokenizer's EOS string, the template's ``eos_token``.
    """

    source: str
    origin: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        _compile(self.source, self.origin)  # a template that is no Jinja fails here

    @property
    def sha256(self) -> str:
        """sha256 of the template's text."""
        return hashlib.sha256(self.source.encode()).hexdigest()

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False, **extra: Any
    ) -> str:
        """The text of ``messages`` (``role``/``content`` dicts), as transformers renders it.

        Args:
            messages: The conversation.
            add_generation_prompt: End with the header of an assistant turn to generate.
            **extra: More template variables (``tools``, ``enable_thinking``, ...).

        Raises:
            ChatTemplateError: If the template raises or fails on the conversation.
        """
        variables = {"tools": None, "documents": None, "bos_token": self.bos_token}
        variables |= {"eos_token": self.eos_token, **extra}
        try:
            return _compile(self.source, self.origin).render(
                messages=_template_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as error:  # a template is code: whatever it raises is its own
            raise ChatTemplateError(
                f"the chat template ({self.origin}) failed on the conversation: {_one_line(error)}"
            ) from None


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None
    dropped, and a reasoning given under any of its names given under all of them."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {text}"


# -- the sandbox (transformers' utils/chat_template_utils.py) ----------------------------


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: its body, rendered in a scope of its own
    (transformers records its span; `ChatEncoder` finds assistant turns itself)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """``dict()`` without the attributes a template could climb out of the sandbox by."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: self in args
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store the underscore name {name!r} on a namespace"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(source: str, origin: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals |= {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
        "dict": _TemplateDict(),
        "namespace": _Namespace,
    }
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"{origin}: not a Jinja template (line {error.lineno}: {error.message}); fix it,"
            " or pass another --template"
        ) from None


# -- where templates come from ---------------------------------------------------------


def load_chat_template(tokenizer_spec: str, template: str | Path | None = None) -> ChatTemplate:
    """The chat template to encode conversations for ``tokenizer_spec`` with.

    Args:
        tokenizer_spec: A `get_tokenizer` spec; its BOS and EOS strings fill the
            template's ``bos_token`` and ``eos_token``.
        template: None: the tokenizer's own (the ``chat_template`` of a Hugging Face
            folder's ``tokenizer_config.json`` or ``chat_template.jinja``, or a GGUF
            file's ``tokenizer.chat_template``); ``"plain"``: `PLAIN_TEMPLATE`; else the
            path of a Jinja file (its origin: the absolute path).

    Raises:
        ChatTemplateError: If the tokenizer has no template and none is given, the file
            cannot be read, or its text is not Jinja.
    """
    tokenizer = get_tokenizer(tokenizer_spec)
    if template is None:
        source, origin = _own_template(tokenizer_spec)
    elif str(template) == "plain":
        source, origin = PLAIN_TEMPLATE, "plain"
    else:  # recorded absolute, so a chat folder names it from anywhere
        path = Path(template).expanduser()
        source, origin = _template_file(path), str(path.resolve())
    bos, eos = (tokenizer.decode([i]) for i in (tokenizer.bos_id, tokenizer.eos_id))
    return ChatTemplate(source, origin, bos_token=bos, eos_token=eos)


def _template_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(
            f"--template {path}: cannot read it ({error}); pass a Jinja file, or plain"
        ) from None


def _own_template(spec: str) -> tuple[str, str]:
    """The tokenizer's own template and its origin."""
    found = None
    if spec not in TOKENIZER_NAMES:  # the built-in vocabularies carry no template
        path = resolve_model_path(spec).expanduser()
        found = _gguf_template(path) if is_gguf(path) else _folder_template(path)
    if found is None:
        raise ChatTemplateError(
            f"tokenizer {spec} has no chat template; pass --template FILE, or --template"
            " plain for a base model"
        )
    return found


def _gguf_template(path: Path) -> tuple[str, str] | None:
    source = read_gguf_metadata(path).get(TOKENIZER_KEYS.CHAT_TEMPLATE)
    return None if source is None else (source, f"GGUF tokenizer.chat_template of {path}")


def _folder_template(path: Path) -> tuple[str, str] | None:
    """A Hugging Face folder's template: ``tokenizer_config.json``'s ``chat_template`` (a
    string, or named templates of which ``default``), else ``chat_template.jinja``."""
    folder = path if path.is_dir() else path.parent
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(
                f"{config_file}: its chat templates {sorted(named)} include no 'default';"
                " pass --template FILE"
            )
        source = named["default"]
    if isinstance(source, str):
        return source, f"tokenizer_config.json of {folder}"
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    return None


# -- encoding --------------------------------------------------------------------------


class ChatEncoder:
    """Conversations as token ids, with the mask of the tokens a model trains on.

    Args:
        tokenizer: A `get_tokenizer` tokenizer (``Tokenizer`` or ``HFTokenizer``).
        template: The template its conversations are written in.
    """

    def __init__(self, tokenizer: Any, template: ChatTemplate) -> None:
        self.tokenizer, self.template = tokenizer, template
        self._specials: dict[str, int] = tokenizer.special_tokens
        longest_first = sorted(self._specials, key=len, reverse=True)
        self._controls = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        self._markers = re.compile(f"{_START}({self._controls.pattern}){_END}|[{_START}{_END}]")
        # UTF-8 bytes each id spells in rendered text: a special, its string.
        self._spelled = tokenizer.token_bytes().astype(np.int64)
        for token, i in self._specials.items():
            self._spelled[i] = len(token.encode())
        self._newline = tokenizer.encode("\n")
        self._stop_ids = self._probe_stop_ids()

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end an assistant turn: EOS, and the special token the template writes
        right after an assistant's text (``<|im_end|>``, ``<|eot_id|>``) if it is another."""
        return list(self._stop_ids)

    def encode(
        self, messages: list[dict], train_on: str = "assistant"
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of a conversation and which of them are training targets.

        Args:
            messages: ``role``/``content`` dicts.
            train_on: ``"assistant"``: every assistant turn; ``"completion"``: the final
                assistant turn; ``"all"``: every token.

        Returns:
            ``(ids, mask)``: int64 ids ``(n,)`` and bool ``(n,)``, True for a target.

        Raises:
            ChatTemplateError: If the conversation does not end with an assistant turn
                (unless ``train_on="all"``), the template refuses it, or the template's
                turns cannot be told apart.
        """
        _check_conversation(messages, train_on)
        marked = self._mark(messages)
        text = self.template.render(marked)
        pieces = self._tokenize(text)
        ids = np.concatenate([piece_ids for _, piece_ids in pieces])
        if train_on == "all":
            return ids, np.ones(len(ids), dtype=bool)
        ends = np.cumsum(np.concatenate([self._spelled_lengths(*piece) for piece in pieces]))
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        mask = np.zeros(len(ids), dtype=bool)
        for turn in turns[-1:] if train_on == "completion" else turns:
            first = self._first_target(marked, turn, text, ends)
            mask[first : self._stop_index(ids, first, turn) + 1] = True
        return ids, mask

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` followed by the template's generation prompt: what a
        model continues with an assistant turn."""
        text = self.template.render(self._mark(messages), add_generation_prompt=True)
        return [int(i) for _, piece_ids in self._tokenize(text) for i in piece_ids]

    def _mark(self, value: Any) -> Any:
        """Every special token string in a message wrapped in the markers (any marker
        already there removed, so none can be forged)."""
        if isinstance(value, str):
            value = value.replace(_START, "").replace(_END, "")
            return self._controls.sub(lambda m: f"{_START}{m.group()}{_END}", value)
        if isinstance(value, dict):
            return {key: self._mark(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._mark(item) for item in value]
        return value

    def _tokenize(self, text: str) -> list[tuple[str, np.ndarray]]:
        """Rendered (marked) text as pieces without markers, each with its ids.

        As transformers' ``encode_marked_chat``: the template's text with specials parsed,
        each marked special as plain text, and every piece after the first encoded after a
        newline that is then dropped (so SentencePiece adds no space in front).
        """
        split = self._markers.split(text)  # [text, marked, text, marked, ..., text]
        pieces = [(split[0], np.asarray(self.tokenizer.encode_with_specials(split[0]), np.int64))]
        for k, piece in enumerate(split[1:], start=1):
            if not piece:
                continue  # a lone marker
            plain = k % 2 == 1
            encode = self.tokenizer.encode if plain else self.tokenizer.encode_with_specials
            piece_ids = encode("\n" + piece)
            if piece_ids[: len(self._newline)] == self._newline:
                piece_ids = piece_ids[len(self._newline) :]
            else:
                piece_ids = encode(piece)
            pieces.append((piece, np.asarray(piece_ids, np.int64)))
        return pieces

    def _spelled_lengths(self, text: str, ids: np.ndarray) -> np.ndarray:
        """UTF-8 bytes of ``text`` each of its ``ids`` spells."""
        lengths = self._spelled[ids]
        size = len(text.encode("utf-8", "surrogatepass"))
        extra = int(lengths.sum()) - size
        if 0 < extra <= (lengths[0] if len(lengths) else 0):
            # A SentencePiece tokenizer leads a text with a ▁ it counts as a space.
            lengths = lengths.copy()
            lengths[0] -= extra
        elif extra:
            raise ChatTemplateError(
                f"the {self.tokenizer.name} tokens of a rendered conversation spell"
                f" {size + extra} bytes of its {size} (unknown tokens?), so which are the"
                " assistant's cannot be told; pass --train_on all"
            )
        return lengths

    def _first_target(self, marked: list[dict], turn: int, text: str, ends: np.ndarray) -> int:
        """The first token of assistant message ``turn``: the first that ends after the
        generation prompt before it."""
        prompt = self.template.render(marked[:turn], add_generation_prompt=True)
        if not text.startswith(prompt):
            raise ChatTemplateError(
                f"the chat template ({self.template.origin}) cannot be split into turns: the"
                f" conversation up to message {turn + 1} with the generation prompt is not"
                " where the whole conversation starts; pass --train_on all, or another"
                " --template"
            )
        start = len(self._markers.sub(r"\1", prompt).encode("utf-8", "surrogatepass"))
        return int(np.searchsorted(ends, start, side="right"))

    def _stop_index(self, ids: np.ndarray, first: int, turn: int) -> int:
        """The index of the first stop token at or after ``first``."""
        hits = np.flatnonzero(np.isin(ids[first:], self._stop_ids))
        if not len(hits):
            names = [self.tokenizer.decode([i]) for i in self._stop_ids]
            raise ChatTemplateError(
                f"the chat template ({self.template.origin}) ends assistant message"
                f" {turn + 1} with none of {self.tokenizer.name}'s stop tokens {names}, so a"
                " model trained on it would never stop; use a template that ends assistant"
                " turns with {{ eos_token }}, or --template plain"
            )
        return first + int(hits[0])

    def _probe_stop_ids(self) -> tuple[int, ...]:
        """EOS, and the first special token the template writes after an assistant's text
        in a one-exchange conversation (if it renders one)."""
        eos = self.tokenizer.eos_id
        try:
            text = self.template.render(list(_PROBE))
            prompt = self.template.render(list(_PROBE[:1]), add_generation_prompt=True)
        except ChatTemplateError:
            return (eos,)
        answer = _PROBE[1]["content"]
        at = text.find(answer, len(prompt)) if text.startswith(prompt) else -1
        found = self._controls.search(text, at + len(answer)) if at >= 0 else None
        return tuple(sorted({eos} | ({self._specials[found.group()]} if found else set())))


def _check_conversation(messages: list[dict], train_on: str) -> None:
    if train_on not in TRAIN_ON:
        raise ChatTemplateError(f"train_on {train_on!r}: choose one of {', '.join(TRAIN_ON)}")
    if not messages:
        raise ChatTemplateError("the conversation holds no message; give it at least one")
    last = messages[-1].get("role")
    if train_on != "all" and last != "assistant":
        raise ChatTemplateError(
            f"the conversation ends with a {last} message, not an assistant's, so"
            f" train_on={train_on} has no answer to train on; end it with the assistant's"
            " answer, or pass --train_on all"
        )
