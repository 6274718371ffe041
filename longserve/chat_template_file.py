"""--chat-template's value as vLLM reads it (EngineConfig.chat_template): a file's contents, or the Jinja text."""

from __future__ import annotations

import codecs

from longserve.settings_errors import ConfigError, ConfigPathError


def load_chat_template(value: str) -> str:
    """--chat-template's value as vLLM reads it: a file's contents when it names a readable file, else the
    Jinja text itself when it looks like a template (has `{`, `}` or a line break; an escaped `\\n` typed
    in a shell becomes a line break), else ConfigError (a path that cannot be read)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"chat_template must be a file path or a Jinja template; got {value!r}", "chat_template"
        )
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte (not a path)
        if not any(c in value for c in "{}\n"):
            reason = getattr(e, "strerror", None) or str(e)
            raise ConfigPathError(
                f"chat_template={value!r} looks like a file path, but it cannot be read ({reason}); give a "
                "template file or the Jinja template text",
                "chat_template",
            ) from None
        text = value
        if "\n" not in text and "\\n" in text and text.isascii():
            text = codecs.decode(text, "unicode_escape")
    if not text.strip():
        raise ConfigError(f"chat_template {value!r} is empty", "chat_template")
    return text
