"""Write docs/configuration.md from the typed schemas and the presets in conf/.

    python scripts/config_docs.py            # rewrite docs/configuration.md
    python scripts/config_docs.py --check    # exit 1 when docs/configuration.md is stale

The page is the hand-written introduction (scripts/config_docs_intro.md), then, generated:

* every Hydra group (a folder of conf/) with its options (the YAML presets), each with the first
  paragraph of the preset's leading comment;
* every key of every schema (the dataclasses of :mod:`fedadapt.config`, rooted at ``RunConfig``,
  and each method's own schema, as :func:`fedadapt.entry.register_configs` stores them in
  Hydra's ConfigStore) with its type, its default and the ``#:`` comment above the field;
* the keys of every ``strategy=`` and ``dp=`` option (read from Flower's signatures by
  :mod:`fedadapt.strategies.registry`).

``tests/test_docs.py`` checks that the file equals what this script writes now.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
OUT = ROOT / "docs" / "configuration.md"
INTRO = Path(__file__).with_name("config_docs_intro.md")
WIDTH = 100

#: Groups in the order a reader meets them; any other folder of conf/ follows, sorted.
GROUP_ORDER = ["experiment", "dataset", "backbone", "method", "partition", "setting", "strategy",
               "dp", "search", "hydra/launcher"]


def _md(text: str) -> str:
    """Docstring / comment markup (reStructuredText roles) as Markdown."""
    text = re.sub(r":(?:func|mod|class|meth|data|attr|exc):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _wrap(text: str, indent: str = "") -> list[str]:
    """``text`` on lines of at most WIDTH characters, the lines after the first indented."""
    return textwrap.wrap(" ".join(text.split()), WIDTH, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


# -- presets ------------------------------------------------------------------------------------

def leading_comment(path: Path) -> str:
    """The first paragraph of a preset's first comment block (``@package`` lines skipped; the
    paragraph ends at an empty comment line, an indented command line or a list)."""
    lines, started = [], False
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line.startswith("#") or line.startswith("# @package"):
            if started:
                break
            continue
        body = line[1:]
        if started and (not body.strip() or body.startswith("   ")
                        or body.strip().startswith("- ")):
            break
        started = True
        lines.append(body.strip())
    text = " ".join(lines)
    return _md(text[:-1] + "." if text.endswith(":") else text)


def groups() -> dict[str, list[Path]]:
    """``{group: [preset files]}`` for every folder of conf/ that holds presets."""
    found: dict[str, list[Path]] = {}
    for path in sorted(CONF.rglob("*.yaml")):
        group = path.parent.relative_to(CONF).as_posix()
        if group != ".":
            found.setdefault(group, []).append(path)
    order = [g for g in GROUP_ORDER if g in found] + sorted(set(found) - set(GROUP_ORDER))
    return {g: found[g] for g in order}


def method_schema_of(path: Path) -> str:
    """The method schema a ``conf/method`` preset extends (``/schema/method/<name>@_here_``)."""
    for entry in yaml.safe_load(path.read_text()).get("defaults", []):
        match = re.fullmatch(r"/schema/method/(\w+)@_here_", str(entry))
        if match:
            return match.group(1)
    return "?"


def preset_values(path: Path) -> str:
    """What a method preset sets besides its name, as ``key: value`` pairs."""
    data = yaml.safe_load(path.read_text()) or {}
    pairs = [f"`{k}: {_value(v)}`" for k, v in data.items() if k not in ("defaults", "name")]
    return ", ".join(pairs)


# -- schemas ------------------------------------------------------------------------------------

def field_comments(cls: type) -> dict[str, str]:
    """``{field: text}`` of the ``#:`` comment lines right above each field of ``cls`` (and of
    the classes it extends)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        body = ast.parse(source).body[0].body
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                comment, i = [], node.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#:"):
                    comment.insert(0, lines[i].strip()[2:].strip())
                    i -= 1
                if comment:
                    out[node.target.id] = _md(" ".join(comment))
    return out


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("typing.", "")


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _default(f: dataclasses.Field) -> str:
    from omegaconf import MISSING

    if f.default is not dataclasses.MISSING:
        return "required" if f.default == MISSING else f"`{_value(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{_value(f.default_factory())}`"
    return "required"


def key_list(cls: type, prefix: str, skip: tuple[str, ...] = (), only_scalars=False) -> list[str]:
    """One bullet per field: ``- `prefix.key` (type, default): comment``."""
    comments = field_comments(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if f.name in skip or (only_scalars and dataclasses.is_dataclass(_field_class(cls, f))):
            continue
        default = _default(f)
        default = default if default == "required" else f"default {default}"
        head = f"- `{prefix}{f.name}` (`{_type(f)}`, {default})"
        text = comments.get(f.name, "")
        lines += _wrap(f"{head}: {text}" if text else head, indent="  ")
    return lines


def _field_class(cls: type, f: dataclasses.Field):
    try:
        return typing.get_type_hints(cls).get(f.name)
    except Exception:  # a hint that does not resolve is not a sub-config
        return None


def docstring(cls: type) -> list[str]:
    doc = inspect.getdoc(cls) or ""
    if not doc or doc.startswith(cls.__name__ + "("):  # dataclass's generated signature
        return []
    return _md(doc).splitlines() + [""]


# -- the page -----------------------------------------------------------------------------------

def schemas(group: str) -> dict[str, type]:
    """``{option: dataclass}`` of the schemas registered under ConfigStore's ``schema/<group>``
    (what :func:`fedadapt.entry.register_configs` stores: every method, strategy, DP wrapper)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from fedadapt.entry import register_configs

    register_configs()
    store = ConfigStore.instance()
    found = {name.removesuffix(".yaml"): OmegaConf.get_type(
        store.load(f"schema/{group}/{name}").node) for name in store.list(f"schema/{group}")}
    # fedadapt's own (a test or a user's module may register methods of its own)
    return {k: v for k, v in found.items() if v.__module__.startswith("fedadapt.")}


def render() -> str:
    from fedadapt.config import MethodConfig, RunConfig

    out = INTRO.read_text().rstrip("\n").splitlines() + [""]
    found = groups()

    out += ["## Groups and their options", ""]
    out += _wrap("Each group is a folder of `conf/`; its options are the YAML presets in it "
                 "(`fedadapt GROUP=OPTION`), each with the first paragraph of its leading "
                 "comment.") + [""]
    for group, paths in found.items():
        out += [f"### `{group}=`", ""]
        for path in paths:
            what = leading_comment(path)
            extra = ""
            if group == "method":
                values = preset_values(path)
                extra = f" Schema `{method_schema_of(path)}`" + (f"; sets {values}." if values
                                                                 else ".")
            text = (what + extra).strip()
            lines = _wrap(f"- `{path.stem}`" + (f": {text}" if text else ""), indent="  ")
            out += lines
        out += [""]

    out += ["## Keys", ""]
    out += _wrap("Every key with its type and default, from the schemas "
                 "(`fedadapt/config.py`; each method registers its own). A preset sets some of "
                 "them; `fedadapt --cfg job [overrides]` prints the values a run would "
                 "use.") + [""]

    out += ["### Top level (`RunConfig`)", ""] + docstring(RunConfig)
    out += key_list(RunConfig, "", only_scalars=True) + [""]

    for f in dataclasses.fields(RunConfig):
        cls = _field_class(RunConfig, f)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        if f.name in ("method", "strategy", "dp", "fleet"):
            continue
        out += [f"### `{f.name}.` (`{cls.__name__}`)", ""] + docstring(cls)
        out += key_list(cls, f"{f.name}.") + [""]

    # methods: the keys every method has, then each method schema's own keys and its presets
    out += ["### `method.` (`MethodConfig`, and each method's schema)", ""]
    out += docstring(MethodConfig)
    out += ["Keys of every method:", ""] + key_list(MethodConfig, "method.") + [""]
    base = {f.name for f in dataclasses.fields(MethodConfig)}
    presets: dict[str, list[str]] = {}
    for path in found.get("method", []):
        presets.setdefault(method_schema_of(path), []).append(path.stem)
    for name, cls in schemas("method").items():
        out += [f"#### Schema `{name}` (`{cls.__name__}`)", ""]
        used = ", ".join(f"`{p}`" for p in presets.get(name, [])) or "none"
        out += _wrap(f"Presets: {used}.") + [""]
        own = key_list(cls, "method.", skip=tuple(base))
        out += (own or ["No keys beyond those of every method."]) + [""]

    # fleets: each kind's schema and its own keys
    from fedadapt.config import FleetConfig

    out += ["### `fleet.` (`FleetConfig`, and each fleet kind's schema)", ""]
    out += docstring(FleetConfig) + key_list(FleetConfig, "fleet.") + [""]
    for name, cls in schemas("fleet").items():
        if cls is FleetConfig:
            continue
        out += [f"#### `fleet={name}` (`{cls.__name__}`)", ""] + docstring(cls)
        out += key_list(cls, "fleet.", skip=("name",)) + [""]

    out += ["### `strategy.` and `dp.` (from Flower's signatures)", ""]
    out += _wrap("Each option's keys are its Flower class's constructor parameters (defaults as "
                 "Flower's); [strategies.md](strategies.md) says what each option does and which "
                 "parameters follow from the rest of the config.") + [""]
    for group in ("strategy", "dp"):
        for name, schema in schemas(group).items():
            keys = [f"`{group}.{f.name}={_value(_plain_default(f))}`"
                    for f in dataclasses.fields(schema) if f.name != "name"]
            out += _wrap(f"- `{group}={name}`: " + (", ".join(keys) if keys else "no keys"),
                         indent="  ")
        out += [""]
    return "\n".join(out).rstrip("\n") + "\n"


def _plain_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/configuration.md differs from what it would be")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/configuration.md is stale: python scripts/config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
