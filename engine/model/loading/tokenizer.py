"""Tokenizer through the ``tokenizers`` library, built from an HF ``tokenizer.json``
or from a GGUF file's vocabulary: byte-level BPE (``tokenizer.ggml.model = gpt2``, with
the file's merges) or Gemma's SentencePiece BPE with byte fallback (``llama``, merges
derived from the vocabulary's order); the chat template (GGUF metadata,
tokenizer_config.json, or Gemma's standard one) rendered with jinja2 the way HF does;
BOS/EOS/stop tokens; and an incremental detokenizer that checks stop strings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from engine.errors import UserError
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import resolve_model_file

_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4

# llama.cpp pre-tokenizer names whose split regex is GPT-2's plus one token per digit
# (SmolLM2's own tokenizer.json: Digits(individual_digits) then ByteLevel).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# SentencePiece's word-boundary mark: the vocabulary spells a space as this.
SPIECE_SPACE = "\u2581"
# Gemma 3's chat template (google/gemma-3-270m-it's tokenizer_config.json), for GGUF files
# that carry none (llama.cpp's converter leaves it out of some): turns are
# <start_of_turn>user|model ... <end_of_turn>, a system message is folded into the first user turn.
GEMMA3_TEMPLATE_NAME = "Gemma 3's instruction-tuned template (google/gemma-3-270m-it's <start_of_turn> turns)"
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
# A Gemma model ends its turn with this token: a stop token beside <eos>, as in
# google/gemma-3-270m-it's generation_config.json (eos_token_id [1, 106]).
GEMMA_END_OF_TURN = "<end_of_turn>"


def merges_from_vocab_order(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary that lists no merges: every split of a token into
    two vocabulary pieces, best first by the token's place in the vocabulary (Gemma's
    scores do not follow its merge order; the order of the tokens does), then the longer
    left and right pieces first (transformers' ``generate_merges``)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[int, int, int, str, str]] = []
    for token, index in vocab.items():
        local = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                 if token[:cut] in vocab and token[cut:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((-index, len(left), len(right), left, right) for left, right in local)
    # Python's sort is stable: reverse=True keeps equal keys in insertion order, as transformers' does.
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def sentencepiece_bpe(tokens: Sequence[str], types: Sequence[int]) -> BackendTokenizer:
    """Gemma's SentencePiece vocabulary as a ``tokenizers`` BPE with byte fallback: spaces
    become ``▁`` before the model sees the text, and no other pre-tokenization (Gemma's
    own tokenizer.json: a normalizer Replace(" ", "▁"), a Split on " " that then never
    matches). Tokens that are runs of spaces are stored as real spaces in the GGUF and
    respelled with ``▁``. Control tokens are special added tokens; user-defined ones
    (newline runs, ``[multimodal]``) are added tokens matched whole."""
    respelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    bpe = BPE(vocab=vocab, merges=merges_from_vocab_order(respelled), unk_token="<unk>", fuse_unk=True,
              byte_fallback=True)
    backend = BackendTokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL])
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)
    return backend


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _no_template_note(path: Path, fallback: str | None) -> str:
    """The one warning line for a GGUF with no ``tokenizer.chat_template``."""
    if fallback is None:
        return f"{path.name} carries no chat template and kvscope has no fallback for its tokenizer: chat is refused"
    return (f"{path.name} carries no chat template: chats use {fallback}; a base model (no instruction "
            "tuning) answers it by echoing and drifting")


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        extra_stop_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        chat_template_note: str | None = None,
    ) -> None:
        self.backend = backend
        self._max_token_bytes: int | None = None
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        # why a chat may not be what the model was trained on (the GGUF carries no template): warned once
        self.chat_template_note = chat_template_note
        self._chat_template_warned = False
        self.add_bos_token = add_bos_token
        stops = [eos_token_id] if eos_token_id is not None else []
        stops += [t for t in extra_stop_token_ids if t not in stops]
        self.stop_token_ids: list[int] = stops
        self.special_token_ids: set[int] = {
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        }

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        from gguf import GGUFReader

        try:
            reader = GGUFReader(str(path))
        except Exception as exc:
            raise UserError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        model = _gguf_field(reader, "tokenizer.ggml.model")
        if model == "llama":
            return cls._from_gguf_sentencepiece(reader, path)
        if model != "gpt2":
            raise UserError(f"{path}: tokenizer type {model!r} is not supported; byte-level BPE ('gpt2') or "
                            "SentencePiece ('llama', Gemma 3's)")
        tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
        types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        merges: list[str] = _gguf_field(reader, "tokenizer.ggml.merges") or []
        alphabet = set(bytes_to_unicode().values())
        spell = bytes_to_unicode()
        # A few files store a token in plain UTF-8 instead of the byte alphabet; respell it.
        vocab = {
            (tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8"))): i
            for i, tok in enumerate(tokens)
        }
        bpe = BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
        backend = BackendTokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer_for(_gguf_field(reader, "tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        special = [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == _CONTROL and set(tok) <= alphabet
        ]
        user = [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED
        ]
        backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)
        eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
        eot = _gguf_field(reader, "tokenizer.ggml.eot_token_id")
        template = _gguf_field(reader, "tokenizer.chat_template")
        return cls(
            backend,
            bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=eos,
            chat_template=template,
            extra_stop_token_ids=[eot] if eot is not None else [],
            add_bos_token=bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token") or False),
            chat_template_note=None if template else _no_template_note(path, None),
        )

    @classmethod
    def _from_gguf_sentencepiece(cls, reader: Any, path: Path) -> Tokenizer:
        """A SentencePiece vocabulary (Gemma 3's), with Gemma's chat template when the file has none."""
        architecture = _gguf_field(reader, "general.architecture")
        if architecture not in ("gemma3",):
            raise UserError(f"{path}: a SentencePiece ('llama') vocabulary is supported for Gemma 3 files; "
                            f"this one's architecture is {architecture!r}")
        tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
        types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = sentencepiece_bpe(tokens, types)
        end_of_turn = backend.token_to_id(GEMMA_END_OF_TURN)
        eot = _gguf_field(reader, "tokenizer.ggml.eot_token_id")
        add_bos = _gguf_field(reader, "tokenizer.ggml.add_bos_token")
        template = _gguf_field(reader, "tokenizer.chat_template")
        return cls(
            backend,
            bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
            chat_template=template or GEMMA3_CHAT_TEMPLATE,
            extra_stop_token_ids=[t for t in (eot, end_of_turn) if t is not None],
            add_bos_token=True if add_bos is None else bool(add_bos),  # llama.cpp's default for SentencePiece
            chat_template_note=None if template else _no_template_note(path, GEMMA3_TEMPLATE_NAME),
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise UserError(f"{folder}: no tokenizer.json in the model folder")
        try:
            backend = BackendTokenizer.from_file(str(tok_path))
        except Exception as exc:
            raise UserError(f"{tok_path}: not a readable tokenizer.json ({exc})") from exc
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        extra: list[int] = []
        if (folder / "generation_config.json").is_file():
            gen_eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
            extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            chat_template=template,
            extra_stop_token_ids=extra,
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @classmethod
    def for_model(cls, config: ModelConfig) -> Tokenizer:
        location = Path(config.path) if config.path else resolve_model_file(config.name)
        if location is None or not location.exists():
            raise UserError(f"model {config.name!r} has no tokenizer (no GGUF file or HF folder found)")
        return cls.from_hf_folder(location) if location.is_dir() else cls.from_gguf(location)

    # ------------------------------------------------------------------ text <-> ids
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry: no token covers more text than
        that, so ``len(text.encode()) / max_token_bytes`` tokens is a floor for any text."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max((len(t.encode("utf-8")) for t in self.backend.get_vocab(with_added_tokens=True)),
                                        default=1)
        return self._max_token_bytes

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in ``text`` (``<|im_start|>``) map to their ids, as in HF.
        ``add_special_tokens`` prepends BOS when the model asks for it. Text that is
        not valid Unicode (a lone UTF-16 surrogate, which JSON's ``\\ud800`` can
        carry) is a UserError naming the character's position."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UserError(f"the text has a lone UTF-16 surrogate ({text[exc.start]!r}) at character {exc.start}: "
                            "send valid Unicode (pair the surrogate or drop it)") from None
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ chat
    def warn_chat_template_once(self) -> None:
        """Log :attr:`chat_template_note`, the first time only (``generate --chat``, ``LLM.chat``):
        a chat rendered with a fallback template, or refused for want of one, is worth one line."""
        if self.chat_template_note is None or self._chat_template_warned:
            return
        self._chat_template_warned = True
        from engine.logs import get_logger

        get_logger("kvscope.tokenizer").warning(self.chat_template_note)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render ``messages`` with ``chat_template`` (the server's --chat-template) or the
        model's own template."""
        source = chat_template or self.chat_template
        if not source:
            raise UserError("this model has no chat template; send a plain prompt instead")
        template = _compile_template(source)
        text = template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            **extra,
        )
        return self.encode(text) if tokenize else text

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    # ------------------------------------------------------------------ export
    def save_hf(self, folder: Path, model_max_length: int | None = None) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        added = {
            str(i): {"content": t.content, "special": t.special, "normalized": t.normalized,
                     "lstrip": t.lstrip, "rstrip": t.rstrip, "single_word": t.single_word}
            for i, t in sorted(self.backend.get_added_tokens_decoder().items())
        }
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_text(self.bos_token_id) or None,
            "eos_token": self._token_text(self.eos_token_id) or None,
            "add_bos_token": self.add_bos_token,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
            "chat_template": self.chat_template,
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """Compile as HF transformers does: sandboxed, trim/lstrip blocks, loop controls."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise UserError(f"chat template: {message}")

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas and finds stop strings.

    Decodes a small window (``prefix_offset:``) instead of the whole output each
    step, and holds back text ending in an incomplete UTF-8 sequence or in what
    could be the start of a stop string (:meth:`finish` releases it). After
    :meth:`add`, ``stop_reason`` is the matched stop string (the text is cut
    there, the stop string kept only with ``include_stop``) or None. Stop strings
    are found by a :class:`StopMatcher`, whose cost per token follows the new text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.matcher = StopMatcher(self.stop) if self.stop else None
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        # Seed the window with a few prompt tokens so a leading space decodes as in context.
        self.ids: list[int] = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0  # characters of ``text`` already returned by add()
        self.stop_reason: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly visible text ("" if held back or stopped)."""
        if self.stop_reason is not None:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        if self.matcher is None:
            return self._emit(len(self.text))
        match = self.matcher.feed(self.text)
        if match is not None:
            index, stop = match
            self.stop_reason = stop
            self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self.matcher.held)

    def finish(self) -> str:
        """The text held back as a possible stop-string start; call when the request ends."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : end], end
        return delta


class StopMatcher:
    """Finds stop strings in a text that grows piece by piece, at a cost per piece that
    follows the piece's length, not the number of stop strings.

    One Aho-Corasick automaton (pyahocorasick, in C) over the stop strings. ``held`` is
    the automaton's state after the text so far: the length of the longest tail of the
    text that is a proper prefix of some stop string, which the caller holds back
    because the next piece may complete it. A stop string that ends in a new piece
    begins inside that tail or the piece, so :meth:`feed` searches only ``held`` + the
    new piece and returns the earliest stop string that ends in the piece (lowest
    start; on a tie the one listed first) as ``(index, stop)``, or None.

    pyahocorasick does not expose its state, and its resumable search
    (``AutomatonSearchIter.set``) corrupts the heap when the pieces mix BMP and astral
    characters (an emoji after ASCII text; pyahocorasick issue #221, open in 2.3.1), so
    each piece is searched by a fresh ``iter`` over that window and the new state is
    found among the tails of the window, longest first, one trie walk each
    (``longest_prefix``, in C). A tail that fails shortens ``held + new`` by one, so
    the walks over a whole text number at most its length plus one per piece.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        stops = [s for s in stops if s]
        if not stops:
            raise ValueError("StopMatcher needs at least one non-empty stop string")
        self.automaton = compile_stop_strings(tuple(stops))
        self._max_held = max(len(s) for s in stops) - 1
        self.fed = 0  # characters of the text searched so far
        self.held = 0

    def feed(self, text: str) -> tuple[int, str] | None:
        """Search the part of ``text`` not fed yet (``text`` is the whole text so far:
        earlier pieces unchanged, the new one appended)."""
        end, old_end = len(text), self.fed
        if end <= old_end:
            return None
        self.fed = end
        window_start = old_end - self.held
        window = text[window_start:]
        best: tuple[int, int, str] | None = None
        for last, (order, stop) in self.automaton.iter(window):
            start = window_start + last - len(stop) + 1
            if window_start + last >= old_end and (best is None or (start, order) < best[:2]):
                best = (start, order, stop)
        if best is not None:
            return best[0], best[2]
        longest_prefix = self.automaton.longest_prefix
        held = 0
        for begin in range(max(window_start, end - self._max_held), end):
            if longest_prefix(text[begin:]) == end - begin:
                held = end - begin
                break
        self.held = held
        return None


@lru_cache(maxsize=16)
def compile_stop_strings(stops: tuple[str, ...]) -> Any:
    """The Aho-Corasick automaton of ``stops`` (each word's value: ``(order, stop)``, the
    first listing of a duplicate kept). Cached by the list, so a route can build it on a
    worker thread before the engine thread needs it, and a list clients send with every
    request is built once; read-only once built, so requests share it."""
    import ahocorasick

    automaton = ahocorasick.Automaton()
    for order, stop in enumerate(stops):
        if stop and not automaton.exists(stop):
            automaton.add_word(stop, (order, stop))
    automaton.make_automaton()
    return automaton
