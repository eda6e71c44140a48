"""Dry run of the text front end: what the box would say for a text, without a daemon or a model.

``chattts-appliance normalize TEXT`` uses this by default: it reads the same ``config.yaml`` as
the daemon, loads only the checkpoint's tokenizer (``model.path``; milliseconds, no weights) and
runs the same normalizer and sentence split as ``Pipeline.prepare``, so box makers can check
their announcements on any machine that has the checkpoint's ``tokenizer/`` folder. The result
has the fields of the daemon's ``normalized`` reply (:class:`appliance.messages.protocol.Normalized`).
"""

from __future__ import annotations

from typing import Optional

from ..config import Config
from ..errors import CheckpointError, TextError
from .budget import step_cap
from .normalize import Normalizer
from .scripts import describe
from .split import split_text
from .tokenizer import Tokenizer


def load_tokenizer(cfg: Config) -> Tokenizer:
    """The tokenizer of ``cfg.model.path`` (a checkpoint dir, its ``asset/`` or ``tokenizer/``).

    Raises:
        CheckpointError: no ``tokenizer.json`` there (the message says how to get one).
    """
    root = cfg.resolve(cfg.model.path)
    try:
        return Tokenizer.from_dir(root)
    except CheckpointError:
        return Tokenizer.from_dir(root / "tokenizer")


def dry_run(text: str, cfg: Config, tokenizer: Optional[Tokenizer] = None, *,
            prompt: Optional[str] = None, request_id: str = "dry-run") -> dict:
    """Normalize and split ``text`` as the daemon would.

    Args:
        text: what a ``speak`` would carry.
        cfg: the daemon's configuration (``model.path``, ``model.max_prompt_tokens``,
            ``synthesis.prompt``, ``service.max_text_chars``).
        tokenizer: the checkpoint's tokenizer; None = :func:`load_tokenizer`.
        prompt: control tokens before every sentence; None = ``synthesis.prompt``.

    Returns:
        ``{"spoken": [sentence, ...], "tokens": [prompt tokens per sentence, ...],
        "steps": each sentence's decode-step cap (:func:`appliance.text.budget.step_cap` under
        ``synthesis.max_new_tokens``), "unspeakable": [...], "unspeakable_names": [...], "lang": "zh" | "en",
        "cleaned": the text after the markup stage (Markdown, HTML, SSML out: :mod:`appliance.text.markup`),
        "notes": what the normalizer decided, one line each}``.

    Raises:
        TextError: empty, too long or unspeakable text (as the daemon answers it).
        CheckpointError: no tokenizer under ``model.path``.
    """
    if len(text) > cfg.service.max_text_chars:
        raise TextError(f"text of {len(text)} characters is over the limit of {cfg.service.max_text_chars} "
                        f"(service.max_text_chars); split it")
    tok = tokenizer or load_tokenizer(cfg)
    syn = cfg.synthesis
    norm = Normalizer(tok)(text, request_id=request_id, emoji=syn.emoji, list_numbers=syn.list_numbers)
    prompt = syn.prompt if prompt is None else prompt
    sentences = split_text(norm.text, tok, cfg.model.max_prompt_tokens, prompt=prompt, max_steps=syn.max_new_tokens)
    return {"spoken": [s.text for s in sentences], "tokens": [int(s.ids.size) for s in sentences],
            "steps": [step_cap(s.text, syn.max_new_tokens, syn.min_new_tokens) for s in sentences],
            "unspeakable": list(norm.unspeakable), "unspeakable_names": [describe(u) for u in norm.unspeakable],
            "lang": norm.lang, "cleaned": norm.cleaned, "notes": list(norm.notes)}


def shown(reply: dict, text: str) -> list[str]:
    """The lines ``chattts-appliance normalize`` prints for a ``normalized`` reply (a dry run's, with
    its ``cleaned`` text, or the daemon's) about ``text``: the cleaned text when the markup stage
    changed it, each sentence with its prompt tokens and its decode-step cap (where the reply has
    them), each decision of the normalizer, what could not be spoken."""
    out = []
    if reply.get("cleaned") and reply["cleaned"] != text.strip():
        out += ["cleaned (markup removed):"] + ["  " + line for line in reply["cleaned"].splitlines()]
    steps = reply.get("steps") or [None] * len(reply["spoken"])
    out += [f"{k + 1}. {sent}    [{n} tokens" + (f", at most {c} steps = {c / 46.875:.1f} s]" if c else "]")
            for k, (sent, n, c) in enumerate(zip(reply["spoken"], reply["tokens"], steps))]
    out += [f"decided: {line}" for line in reply.get("notes") or []]
    if reply.get("unspeakable"):
        out.append("could not speak: " + ", ".join(reply.get("unspeakable_names") or reply["unspeakable"]))
    return out


def cli_config(config: Optional[str]) -> Config:
    """The configuration ``normalize`` reads: the file the command line found
    (:func:`~appliance.config.find_config`, which already searched the current directory), or
    the defaults for None.

    Raises:
        ConfigError: the file cannot be read or is invalid.
    """
    from ..config import load_config

    return load_config(config)
