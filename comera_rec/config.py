"""Configuration: YAML files and ``key.sub=value`` overrides into nested dataclasses.

Any dataclass works as a config: its fields may be plain values (int, float, str, bool),
``Optional[...]``, ``list[...]`` / ``tuple[...]`` / ``dict[str, ...]`` of those, or other
dataclasses (sections). Unknown keys are errors that list the valid ones.

Example::

    >>> from comera_rec.training import OptimConfig
    >>> load_config(OptimConfig, None, ["lr_cores=0.5", "name=SGD"]).lr_cores
    0.5
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the config dataclasses."""


def _valid_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _convert(tp: Any, value: Any, where: str) -> Any:
    """Check ``value`` against the type ``tp`` and convert it (dicts into dataclasses)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} matches none of {tp}: " + "; ".join(errors))
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, Sequence, typing.Sequence) or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args or [Any] * len(value), value)))
    if origin in (dict, Mapping, typing.Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_convert(kt, k, where): _convert(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build the dataclass ``cls`` from a (nested) mapping, checking keys and types.

    Args:
        cls: a dataclass type.
        data: field values; missing fields keep their defaults.
        where: dotted path used in error messages.

    Raises:
        ConfigError: an unknown key (the message lists the valid ones), a value of the
            wrong type, or a value the dataclass's ``__post_init__`` rejects.

    Example::

        >>> from_dict(Run, {"steps": 5})  # doctest: +SKIP
        Run(optim=Section(lr=0.1), steps=5)
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_dict: {cls!r} is not a dataclass type")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    valid = _valid_keys(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in valid:
            raise ConfigError(
                f"unknown config key {path!r}; valid keys{' of ' + where if where else ''}: {', '.join(valid)}"
            )
        kwargs[key] = _convert(hints[key], value, path)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def to_dict(config: Any) -> Any:
    """A dataclass config as plain dicts / lists (YAML- and JSON-friendly)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into ``(["a", "b"], value)``; the value is parsed as YAML.

    Example::

        >>> parse_override("optim.lr=0.001")
        (['optim', 'lr'], 0.001)
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from e
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], cls: Optional[type] = None) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a nested dict (in place; also returned).

    With ``cls`` given, every key on the path is checked against the dataclass fields
    so a typo fails with the list of valid keys.
    """
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        section: Optional[type] = cls
        for depth, key in enumerate(keys):
            last = depth == len(keys) - 1
            if section is not None and dataclasses.is_dataclass(section):
                valid = _valid_keys(section)
                if key not in valid:
                    where = ".".join(keys[:depth])
                    raise ConfigError(
                        f"unknown config key {'.'.join(keys[: depth + 1])!r} in override {text!r}; "
                        f"valid keys{' of ' + where if where else ''}: {', '.join(valid)}"
                    )
                section = _dataclass_of(typing.get_type_hints(section)[key])
            else:
                section = None
            if last:
                node[key] = value
            else:
                child = node.get(key)
                if child is None:
                    child = node[key] = {}
                elif not isinstance(child, dict):
                    raise ConfigError(f"override {text!r}: {'.'.join(keys[: depth + 1])} is not a section")
                node = child
    return data


def _dataclass_of(tp: Any) -> Optional[type]:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


CONFIG_SUFFIXES = (".yaml", ".yml")


def config_dirs() -> list[Path]:
    """The folders whose ``*.yaml`` files are the shipped run configs, looked up by name.

    Installed from a wheel, ``comera_rec/configs`` holds a copy of the repository's
    ``configs/`` (package data); in a checkout ``comera_rec/configs`` is a link to it, and
    the repository's ``configs/`` itself is the fallback where the link did not survive
    (a file system without symbolic links).
    """
    here = Path(__file__).resolve().parent
    dirs = [Path(__file__).parent / "configs", here.parent / "configs"]
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def shipped_configs() -> dict[str, Path]:
    """The shipped run configs, by name (the file name without ``.yaml``), sorted.

    Example::

        >>> "dlrm_demo" in shipped_configs()
        True
    """
    found: dict[str, Path] = {}
    for d in config_dirs():
        for f in sorted(d.iterdir()):
            if f.suffix in CONFIG_SUFFIXES and f.is_file():
                found.setdefault(f.stem, f)
    return dict(sorted(found.items()))


def resolve_config(name_or_path: Union[str, Path]) -> Path:
    """The YAML file that ``--config`` names: a path, else a shipped config by name.

    - an existing file is used as it is (a local file wins over a shipped name);
    - a bare name (no folder part; ``.yaml`` / ``.yml`` optional), e.g. ``dlrm_demo``, is
      looked up among :func:`shipped_configs`;
    - anything else (a path with a folder part that does not exist) is a
      ``FileNotFoundError``.

    Raises:
        ConfigError: a bare name that is neither a file nor a shipped config (the message
            lists the shipped names).
        FileNotFoundError: a path with a folder part that does not exist.

    Example::

        >>> resolve_config("dlrm_demo").name
        'dlrm_demo.yaml'
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = str(name_or_path)
    available = shipped_configs()
    names = ", ".join(available) or "(none found)"
    if "/" in text or os.sep in text or (os.altsep and os.altsep in text):
        raise FileNotFoundError(f"config file {text} does not exist (shipped configs, by name: {names})")
    stem = path.stem if path.suffix in CONFIG_SUFFIXES else text
    if stem in available:
        return available[stem]
    raise ConfigError(f"unknown config {text!r}: not a file, nor the name of a shipped config; available: {names}")


def load_config(cls: type[T], path: Optional[Union[str, Path]] = None, overrides: Sequence[str] = ()) -> T:
    """Read a YAML file (or nothing: defaults) plus overrides into the dataclass ``cls``.

    Args:
        cls: the top-level config dataclass (e.g. a ``RunConfig`` with sections).
        path: YAML file, or the name of a shipped config (``dlrm_demo``, see
            :func:`resolve_config`); ``None`` starts from the dataclass defaults.
        overrides: ``"key.sub=value"`` strings applied after the file; values are
            parsed with ``yaml.safe_load`` (``steps=10`` is an int, ``name=x`` a string).

    Raises:
        ConfigError: unknown keys (listing the valid ones), wrong types, bad values; an
            empty ``path`` (no keys, or only comments), named in the message; a bare name
            that is neither a file nor a shipped config (listing the shipped names).
        FileNotFoundError: ``path`` (with a folder part) does not exist.

    Example::

        >>> cfg = load_config(Run, "configs/demo.yaml", ["optim.lr=0.5"])  # doctest: +SKIP
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = resolve_config(path)
        with path.open() as f:
            loaded = yaml.safe_load(f)
        if loaded is None:
            # an empty file (or one of comments only) would silently train the defaults
            raise ConfigError(
                f"{path}: the config file is empty (no keys, or only comments); give it the run's "
                f"sections (e.g. copy configs/*.yaml), or leave out --config to train the defaults"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    apply_overrides(data, overrides, cls)
    return from_dict(cls, data)


def save_config(config: Any, path: Union[str, Path]) -> None:
    """Write a dataclass config as YAML (loadable by :func:`load_config`)."""
    with Path(path).open("w") as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)


def run_config_from_args(
    cls: type[T],
    argv: Optional[Sequence[str]],
    description: Optional[str],
    config_help: str = (
        "YAML run config: a path, or the name of a shipped config (configs/*.yaml, e.g. "
        "dlrm_demo); defaults apply without one"
    ),
    resume_help: str = "continue from the newest checkpoint in trainer.run_dir",
    overrides_help: str = "section.key=value, e.g. trainer.max_steps=200",
) -> Optional[T]:
    """The command line every training entry point shares: ``--config``, ``--resume``,
    ``--help-config`` and ``section.key=value`` overrides.

    ``--resume`` becomes the override ``trainer.resume=true``. With ``--help-config`` the
    resolved config is printed as YAML and ``None`` returned (the caller stops).

    Args:
        cls: the run config dataclass (it needs a ``trainer`` section for ``--resume``).
        argv: the arguments (``None``: ``sys.argv[1:]``).
        description: the entry point's help text (its module docstring).
        config_help, resume_help, overrides_help: the help of those arguments.

    Returns:
        The run config, or ``None`` after ``--help-config``.

    Example::

        >>> from comera_rec.transformer.runs import ClassificationRun
        >>> cfg = run_config_from_args(ClassificationRun, ["--resume", "trainer.max_steps=5"], None)
        >>> cfg.trainer.max_steps, cfg.trainer.resume
        (5, True)
    """
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--resume", action="store_true", help=resume_help)
    parser.add_argument("--help-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    args = parser.parse_args(argv)
    if args.config is not None:
        try:
            args.config = resolve_config(args.config)
        except (ConfigError, FileNotFoundError) as e:
            parser.error(str(e))  # exit 2 with the usage and the shipped names
    config = load_config(cls, args.config, args.overrides + (["trainer.resume=true"] if args.resume else []))
    if args.help_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False))
        return None
    return config


# ---------------------------------------------------------------- differences
def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``{"a.b.c": value}`` (keys joined with dots)."""
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for k, v in config.items():
            out.update(flatten_config(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: config}


def short_repr(value: Any, width: int = 80) -> str:
    """``repr(value)``, cut to ``width`` characters with ``...``."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def config_differences(saved: Any, current: Any, ignore: tuple[str, ...] = ("trainer.",)) -> list[str]:
    """``key (checkpoint X, now Y)`` for every config key whose value differs.

    Args:
        saved: the config dict stored in a checkpoint's meta.json.
        current: this run's config dict.
        ignore: key prefixes that may change between a run and its resumption.
    """
    a, b = flatten_config(saved or {}), flatten_config(current or {})
    keys = sorted(set(a) | set(b))
    return [
        f"{k} (checkpoint {short_repr(a.get(k, '<absent>'))}, now {short_repr(b.get(k, '<absent>'))})"
        for k in keys
        if not k.startswith(ignore) and a.get(k, "<absent>") != b.get(k, "<absent>")
    ]
