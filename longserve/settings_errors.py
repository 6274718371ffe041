"""The refusals every entry point shares (EngineConfig's checks, server/args.py, the server's config): each names
the settings it is about as Python keywords, so that a command line can say its own flags (server/args.cli_message).
Re-exported by longserve/config.py, where they are raised most."""

from __future__ import annotations


class SettingsError(Exception):
    """A refusal whose message names settings as Python keywords (`load_format='dummy'`, `context_length`):
    `settings` lists those field names, so that a command line can say its flags instead
    (server/args.cli_message)."""

    def __init__(self, message: str, *settings: str) -> None:
        super().__init__(message)
        self.settings = settings


class ConfigError(SettingsError, ValueError):
    """A setting's value is refused."""


class ConfigPathError(SettingsError, FileNotFoundError):
    """A directory a setting names does not exist or lacks the files it needs."""
