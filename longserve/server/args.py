"""Every command's options from the one option table (server/options.py: `serve`'s flags in SGLang and vLLM
spellings), plus LONGSERVE_* env vars and a YAML file, resolved in one place onto EngineConfig + ServerConfig
(flag > env > file > default); `generate` takes the engine part, `bench latency` a subset (add_engine_args), spelled and
defaulted alike.

Every spelling of an option has an env var (LONGSERVE_ + the flag in upper case, `-` -> `_`, e.g.
LONGSERVE_MODEL_PATH, LONGSERVE_MAX_MODEL_LEN) and a YAML key (the flag without dashes, `-` or `_`).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any

from longserve.config import ConfigError, EngineConfig
from longserve.server.config import ServerConfig
from longserve.server.options import _BY_KEY, _FALSE, _TRUE, OPTIONS, E, Option, S

logger = logging.getLogger("longserve.server")


def _default(target: str) -> Any:
    section, name = target.split(".")
    cls = EngineConfig if section == "engine" else ServerConfig
    f = next(f for f in fields(cls) if f.name == name)
    return None if f.default is MISSING else f.default


def _add_option(container: Any, opt: Option, env: bool = True, default_help: str | None = None) -> None:
    """One option's flags; the default is suppressed so that only flags actually given reach the namespace.
    The help names the default the dataclass gives (or what a None default means), and the env var."""
    default = _default(opt.target)
    default_help = opt.default_help if default_help is None else default_help  # "": none shown
    shown = [f"env {opt.env_names[0]}"] if env else []
    if default_help is not None:
        if default_help:
            shown.append(f"default: {default_help}")
    elif opt.type is not None and default is not None:
        shown.append(f"default: {default}")
    help_text = opt.help + (f" [{'; '.join(shown)}]" if shown else "")
    if opt.type is None:
        container.add_argument(
            *opt.flags,
            dest=opt.target,
            action="store_const",
            const=opt.const,
            default=argparse.SUPPRESS,
            help=help_text,
        )
    else:
        container.add_argument(
            *opt.flags,
            dest=opt.target,
            type=opt.type,
            choices=opt.choices,
            nargs=opt.nargs,
            metavar=None if opt.choices else opt.target.split(".")[1].upper(),
            default=argparse.SUPPRESS,
            help=help_text,
        )


def add_server_args(parser: argparse.ArgumentParser, sections: tuple[str, ...] = (E, S)) -> None:
    """Every option of `sections` (engine., server.), --config FILE.yaml and the model as an optional
    positional argument (`vllm serve MODEL`'s place); read them with `resolve`."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        default=argparse.SUPPRESS,
        help="the model directory, as vLLM's `vllm serve MODEL` places it: the same as --model-path MODEL",
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (keys: flag names)")
    group = parser.add_argument_group(
        "engine and server options (flag > LONGSERVE_* env > --config > default)"
    )
    for opt in OPTIONS:
        if opt.target.startswith(sections):
            _add_option(group, opt)


def add_engine_args(
    container: Any,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    default_help: Mapping[str, str] | None = None,
) -> None:
    """The engine options of EngineConfig fields `only` (default: all) but `exclude`, with `serve`'s
    spellings, help and defaults, for any command (`container`: a parser, group or mutually exclusive group).
    No env vars or YAML: read the flags given with `engine_config_from_args`. `default_help`: field -> what
    its default means in that command."""
    for opt in OPTIONS:
        name = opt.target.removeprefix(E)
        if opt.target.startswith(E) and (only is None or name in only) and name not in exclude:
            _add_option(container, opt, env=False, default_help=(default_help or {}).get(name))


def given_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig field -> value of the engine flags given on the command line."""
    return {k.removeprefix(E): v for k, v in vars(args).items() if k.startswith(E)}


def engine_config_from_args(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """EngineConfig from the engine flags given (over the dataclass defaults) and `fields`, which the command
    decides itself and which win (e.g. `bench latency`'s model directory and KV pool size)."""
    kw = {**given_engine_options(args), **fields}
    config = EngineConfig(**kw)
    if config.tp_size != 1:
        _check_tp_size(config.model, config.tp_size, config.ep_size)
    _check_quantization(config)
    return config


_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}
_BUILTIN_TYPES = (str, int, float)


def engine_keywords(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Python keywords (`LLM(model, **kwargs)`) -> EngineConfig fields, from this one table: a field's name,
    or any spelling of an engine option with `_` for `-` (vLLM's max_model_len, gpu_memory_utilization,
    tensor_parallel_size, block_size, enforce_eager, max_num_seqs, ...; SGLang's disable_radix_cache, ...).
    A string value is read as its flag reads it (dtype="half", schedule_policy="lpm"); a switch takes a bool
    (disable_radix_cache=True: enable_prefix_caching=False). Two spellings that disagree, a server option or
    an unknown keyword is a TypeError naming the closest keyword known."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # field -> the keyword that set it
    for key, value in kwargs.items():
        opt = _BY_KEY.get(key)
        if key in _ENGINE_FIELDS:
            field = key
        elif opt is not None and opt.target.startswith(E):
            field = opt.target.removeprefix(E)
        elif opt is not None:
            raise TypeError(
                f"{key!r} is a server setting ({opt.flags[0]} of `longserve serve`), not an engine one"
            )
        else:
            known = sorted(_ENGINE_FIELDS | {k for k, o in _BY_KEY.items() if o.target.startswith(E)})
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
            raise TypeError(f"unknown engine argument {key!r}: {hint}")
        if opt is not None and opt.target == E + field:
            if opt.type is None:  # a switch: True sets what the flag sets
                if isinstance(value, bool) and isinstance(opt.const, bool):
                    value = value if opt.const else not value
                elif value is True:
                    value = opt.const
                elif value is False:
                    continue  # the switch not given: the default
            elif isinstance(value, str) and opt.type not in _BUILTIN_TYPES:
                try:
                    value = opt.type(value)
                except ValueError as e:
                    raise ConfigError(f"{key}={e}", field) from None  # e: "'half': expected ..."
        if field in out and out[field] != value:
            raise TypeError(
                f"{given[field]}={kwargs[given[field]]!r} and {key}={kwargs[key]!r} set the same setting "
                f"({field}) differently; give one"
            )
        out[field] = value
        given[field] = key
    return out


# field name -> its flag in messages: the first spelling of the first option that sets it
_FLAG_OF = {}
for _opt in OPTIONS:
    _FLAG_OF.setdefault(_opt.target.split(".")[1], _opt.flags[0])
_VALUE = r"""'([^']*)'|"([^"]*)"|(\d[\d,._]*\d|\d|[^\s,;)\]]+)"""


def cli_message(exc: BaseException) -> str:
    """An error's message as a command line says it: the settings it names (config.SettingsError.settings)
    become flags, `load_format='dummy'` -> `--load-format dummy`, `tokenizer=DIR` -> `--tokenizer-path DIR`,
    `context_length` -> `--context-length`."""
    text = str(exc)
    for name in getattr(exc, "settings", ()):
        flag = _FLAG_OF.get(name)
        if flag is None:
            continue
        text = re.sub(
            rf"(?<![\w.-]){name}=(?:{_VALUE})",
            lambda m, f=flag: f"{f} {next(g for g in m.groups() if g is not None)}",
            text,
        )
        if "_" in name:  # a bare one-word name ("tokenizer", "device") reads as prose: left as it is
            text = re.sub(rf"(?<![\w.-]){name}(?![\w=-])", flag, text)
    return text


def build_parser(prog: str = "longserve serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over HTTP: OpenAI API (/v1/...), SGLang's /generate, admin endpoints.",
    )
    add_server_args(parser)
    return parser


def _convert(opt: Option, value: Any, source: str) -> Any:
    """A value from the environment (str) or YAML (any) to the option's type."""
    try:
        if opt.type is None:
            flag = value if isinstance(value, bool) else str(value).strip().lower()
            if flag not in (True, False) and flag not in _TRUE | _FALSE:
                raise ValueError("expected true/false")
            on = flag is True or flag in _TRUE
            return opt.const if on else not opt.const
        if opt.nargs:
            items = value if isinstance(value, list) else str(value).replace(",", " ").split()
            return [opt.type(str(v)) for v in items]
        converted = opt.type(value if isinstance(value, str) else str(value))
        if opt.choices and converted not in opt.choices:
            raise ValueError(f"expected one of {', '.join(opt.choices)}")
        return converted
    except ValueError as e:
        raise ValueError(f"{source}={value!r}: {e}") from None


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, tuple[str, Any]] = {}
    for opt in OPTIONS:
        for name in opt.env_names:
            if name in environ:
                value = _convert(opt, environ[name], name)
                prev = values.get(opt.target)
                if prev is not None and prev[1] != value:
                    raise ValueError(f"{prev[0]} and {name} disagree; set only one")
                values[opt.target] = (name, value)
    return {target: value for target, (_, value) in values.items()}


def _from_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of option: value")
    values: dict[str, Any] = {}
    for key, value in data.items():
        opt = _BY_KEY.get(str(key).replace("-", "_"))
        if opt is None:
            known = ", ".join(sorted(k.replace("_", "-") for k in _BY_KEY))
            raise ValueError(f"--config {path}: unknown option {key!r}; known: {known}")
        values[opt.target] = _convert(opt, value, f"{path}: {key}")
    return values


def resolve(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, ServerConfig]:
    """Flags (given ones only) over LONGSERVE_* env over the --config file over the dataclass defaults."""
    environ = os.environ if environ is None else environ
    given = {k: v for k, v in vars(args).items() if k.startswith((E, S))}
    positional = getattr(args, "model_tag", None)
    if positional is not None:
        flag = given.get(E + "model")
        if flag is not None and os.path.normpath(flag) != os.path.normpath(positional):
            raise ValueError(
                f"the model is given twice, as MODEL ({positional!r}) and as --model-path/--model ({flag!r}); "
                "give it once"
            )
        given[E + "model"] = positional
    config_file = getattr(args, "config", None) or environ.get("LONGSERVE_CONFIG")
    merged = {**(_from_file(config_file) if config_file else {}), **_from_env(environ), **given}
    engine_kw = {k.removeprefix(E): v for k, v in merged.items() if k.startswith(E)}
    server_kw = {k.removeprefix(S): v for k, v in merged.items() if k.startswith(S)}
    if not engine_kw.get("model"):
        from longserve.assets import default_model_path

        engine_kw["model"] = default_model_path()
        logger.info(
            "no model given (--model-path DIR): serving the small built-in demo model %s", engine_kw["model"]
        )
    if "served_model_name" in server_kw:
        server_kw["served_model_name"] = tuple(server_kw["served_model_name"])
    engine = EngineConfig(**engine_kw)
    if engine.tp_size != 1:
        _check_tp_size(engine.model, engine.tp_size, engine.ep_size)
    _check_quantization(engine)
    return engine, ServerConfig(**server_kw)


def _check_tp_size(model: str, tp_size: int, ep_size: int = 1) -> None:
    """Refuse a tp (and ep) size the model cannot split before anything starts (needs config.json)."""
    if not os.path.isfile(os.path.join(model, "config.json")):
        return  # EngineConfig reports it
    from longserve.models import load_hf_config
    from longserve.models.decoder import validate_tp_size

    validate_tp_size(load_hf_config(model), tp_size, ep_size)


def _check_quantization(engine: EngineConfig) -> None:
    """Refuse a weight format longserve cannot load (config.json's quantization_config against
    --quantization) before anything starts (needs config.json)."""
    path = os.path.join(engine.model, "config.json")
    if not os.path.isfile(path):
        return  # EngineConfig reports it
    with open(path) as f:
        declared = "quantization_config" in f.read()
    if not (declared or engine.quantization or engine.hf_overrides):
        return  # a float checkpoint, nothing forced: nothing to check (and no transformers import)
    from longserve.models import load_hf_config
    from longserve.models.pooler import apply_hf_overrides
    from longserve.models.quant.config import apply_quantization

    hf_config = apply_hf_overrides(load_hf_config(engine.model), engine.hf_overrides)
    apply_quantization(hf_config, engine.quantization, engine.load_format)


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None):
    """argv -> (EngineConfig, ServerConfig); argparse exits on a malformed flag, ValueError on bad values."""
    return resolve(build_parser().parse_args(argv), environ)
