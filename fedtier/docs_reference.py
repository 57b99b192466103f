"""The docs site's generated references, written from the code that defines each thing (one source of truth).

- :func:`config_reference`: every config key from the pydantic models (``protocols/config/`` and each
  algorithm's ``Params``): type, default, constraints, description;
- :func:`cli_reference`: every ``fedtier`` command and option from the click commands;
- :func:`metrics_reference`: every Prometheus metric from the exporter's declarations (``monitor/record_metrics.py``);
- :func:`topics_reference`: the MQTT topic map from ``protocols/wire/topics.py``.

The MkDocs hook ``scripts/mkdocs_hooks.py`` puts them into the pages at build time (a page holds
``<!-- fedtier-reference: config -->``); ``python -m fedtier.docs_reference config`` prints one.
:func:`missing_descriptions` lists config keys that lack a description (a test fails on any).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# ---------------------------------------------------------------------------------------------- config


def _type_name(annotation: Any) -> str:
    """A short readable type: ``int``, ``float | None``, ``"a" | "b"``, ``list[str]``."""
    origin = get_origin(annotation)
    if annotation is type(None):
        return "none"
    if origin is Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a}`" for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in get_args(annotation))
    if origin is not None:
        args = get_args(annotation)
        name = getattr(origin, "__name__", str(origin))
        if name == "tuple" and len(args) == 2 and args[1] is Ellipsis:
            return f"list[{_type_name(args[0])}]"
        if name in ("tuple", "list", "dict"):
            return f"{'list' if name == 'tuple' else name}[{', '.join(_type_name(a) for a in args)}]"
        return name
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


_BOUNDS = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))


def _constraints(field: FieldInfo) -> str:
    out = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"{sign} {getattr(meta, attr)}")
        if isinstance(meta, at.MinLen):
            out.append(f"length ≥ {meta.min_length}")
        if isinstance(meta, at.MaxLen):
            out.append(f"length ≤ {meta.max_length}")
    return ", ".join(out)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def _field_row(key: str, field: FieldInfo) -> str:
    desc = _cell(field.description or "")
    return f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {_constraints(field)} | {desc} |"


_HEAD = "| key | type | default | constraint | description |\n|---|---|---|---|---|"


def _sections() -> Iterator[tuple[str, type[BaseModel]]]:
    from protocols.config import RunConfig

    for name, field in RunConfig.model_fields.items():
        if inspect.isclass(field.annotation) and issubclass(field.annotation, BaseModel):
            yield name, field.annotation


def _algorithm_fields() -> dict[type[BaseModel], dict[str, FieldInfo]]:
    """Each algorithm key, grouped by the ``Params`` class that declares it (shared groups appear once)."""
    from protocols.algorithms import ALGORITHMS

    groups: dict[type[BaseModel], dict[str, FieldInfo]] = {}
    for algo in ALGORITHMS.values():
        params: type[BaseModel] = algo.Params
        for key, field in params.model_fields.items():
            owner = next(c for c in params.__mro__ if key in c.__dict__.get("__annotations__", {}))
            groups.setdefault(owner, {})[key] = field
    return groups


def _users(owner: type[BaseModel]) -> list[str]:
    from protocols.algorithms import ALGORITHMS

    return sorted(name for name, algo in ALGORITHMS.items() if issubclass(algo.Params, owner))


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "").split("\n\n")[0].replace("\n", " ")


def config_reference() -> str:
    """Markdown: one table per config section, and the ``[algorithm]`` keys grouped by who declares them."""
    out: list[str] = []
    for name, section in _sections():
        out += [f"## `[{name}]`", ""]
        if section.__doc__:
            out += [_doc(section), ""]
        out += [_HEAD, *(_field_row(k, f) for k, f in section.model_fields.items()), ""]
    out += [
        "## `[algorithm]`",
        "",
        "`name` picks the algorithm; the other keys are that algorithm's parameters (unknown keys are errors).",
        "Keys are grouped by the parameter class that declares them; each group says which algorithms take it.",
        "",
    ]
    for owner, fields in sorted(_algorithm_fields().items(), key=lambda kv: (len(kv[0].__mro__), kv[0].__name__)):
        users = ", ".join(f"`{u}`" for u in _users(owner))
        out += [f"### {owner.__name__} ({users})", ""]
        if owner.__doc__:
            out += [_doc(owner), ""]
        out += [_HEAD, *(_field_row(k, f) for k, f in fields.items()), ""]
    return "\n".join(out)


def missing_descriptions() -> list[str]:
    """``section.key`` of every config field (algorithm parameters included) without a description."""
    missing = [f"{s}.{k}" for s, model in _sections() for k, f in model.model_fields.items() if not f.description]
    for owner, fields in _algorithm_fields().items():
        missing += [f"algorithm.{k} ({owner.__name__})" for k, f in fields.items() if not f.description]
    return sorted(set(missing))


# ---------------------------------------------------------------------------------------------- CLI


def _param_row(param: click.Parameter, ctx: click.Context) -> str:
    if isinstance(param, click.Option):
        names = ", ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
        meta = "" if param.is_flag else _cell(param.make_metavar(ctx))
        default = param.default
        unset = default is getattr(click.core, "UNSET", object()) or default in (None, (), False)
        shown = "" if unset or callable(default) else f"`{default}`"
        return f"| {names} | {meta} | {shown} | {_cell(param.help or '')} |"
    return f"| `{param.human_readable_name}` (argument) | {_cell(param.make_metavar(ctx))} | | |"


def _commands(
    group: click.Group, ctx: click.Context, prefix: str
) -> Iterator[tuple[str, click.Command, click.Context]]:
    for name in sorted(group.list_commands(ctx)):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        sub = click.Context(cmd, info_name=name, parent=ctx)
        yield f"{prefix} {name}", cmd, sub
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, sub, f"{prefix} {name}")
        for word, extra in sorted(getattr(cmd, "subcommands", {}).items()):  # declared by a command itself
            yield f"{prefix} {name} {word}", extra, click.Context(extra, info_name=f"{name} {word}", parent=ctx)


def cli_reference() -> str:
    """Markdown: usage, help and options of every ``fedtier`` command."""
    from fedtier.cli import main

    root = click.Context(main, info_name="fedtier")
    out = ["| command | what |", "|---|---|"]
    cmds = list(_commands(main, root, "fedtier"))
    for path, cmd, _ in cmds:
        anchor = path.replace(" ", "-")
        out.append(f"| [`{path}`](#{anchor}) | {_cell(cmd.get_short_help_str(limit=120))} |")
    out.append("")
    for path, cmd, ctx in cmds:
        anchor = path.replace(" ", "-")
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        out += [f"## `{path}` {{#{anchor}}}", "", "```text", f"{path} {usage}", "```", ""]
        out += [inspect.cleandoc(cmd.help or ""), ""]
        params = [p for p in cmd.get_params(ctx) if not getattr(p, "hidden", False)]
        if params:
            out += ["| option | value | default | what |", "|---|---|---|---|"]
            out += [_param_row(p, ctx) for p in params]
            out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- metrics


def _declared_metrics() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``(name, type, help, labels)`` of every metric the exporters declare (the record families, an agent's, a
    cell's fleet, a certificate's)."""
    from prometheus_client.metrics import MetricWrapperBase

    from monitor.exporter import AgentCollector, DeviceFleetCollector, MetricsExporter

    found: list[tuple[str, str, str, tuple[str, ...]]] = []
    exporter = MetricsExporter("run")
    groups = (exporter.cell_outcomes, exporter.cell_health, exporter.cloud_rounds, exporter.cloud_cells)
    for value in [v for group in groups for v in vars(group).values()]:
        if isinstance(value, MetricWrapperBase):
            name = value._name + ("_total" if value._type == "counter" else "")
            found.append((name, str(value._type), str(value._documentation), tuple(value._labelnames)))

    class _Agents:  # the attributes AgentCollector reads, empty
        agents: dict[str, Any] = {}
        connections: dict[str, int] = {}
        train_seconds = 0.0

    class _Cell:  # the attributes DeviceFleetCollector reads: one device that announced everything
        devices, online = ["d"], {"d": True}
        caps = {
            "d": {"fedtier": "0", "wire": 1, "accelerator": "none", "backends": "torch", "cores": 1, "memory_mb": 1}
        }

    fleet = DeviceFleetCollector("run")
    fleet.servers["cell"] = _Cell()
    exporter.watch_certificate("node", "")  # unreadable: NaN, but its labels are there
    certificate = [f for f in exporter.registry.collect() if f.name.startswith("fedtier_certificate")]
    for family in [*AgentCollector("run", _Agents()).collect(), *fleet.collect(), *certificate]:
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = tuple(family.samples[0].labels) if family.samples else ()
        found.append((str(name), str(family.type), str(family.documentation), labels))
    return found


def metrics_reference() -> str:
    """Markdown: one table of every Prometheus metric: name, type, labels, what it measures."""
    out = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for name, kind, doc, labels in sorted(_declared_metrics()):
        out.append(f"| `{name}` | {kind} | {', '.join(f'`{x}`' for x in labels)} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- topics


def _topic_functions() -> list[tuple[str, Callable[..., str]]]:
    from protocols.wire import topics

    skip = {"check_name", "tier_of", "device_node", "cell_node"}
    return [
        (name, fn)
        for name, fn in inspect.getmembers(topics, inspect.isfunction)
        if fn.__module__ == topics.__name__
        and not name.startswith("_")
        and name not in skip
        and inspect.signature(fn).return_annotation in (str, "str")  # a topic, not a set of them (job patterns)
    ]


def topics_reference() -> str:
    """Markdown: every topic function of ``protocols/wire/topics.py`` with the topic it makes, its tier
    (for byte counts) and who must sign a record on it."""
    from protocols.wire import topics
    from protocols.wire.signed import signer_of

    out = ["| function | topic | tier | record signer | what |", "|---|---|---|---|---|"]
    for name, fn in _topic_functions():
        args = {p: "{" + p + "}" for p in inspect.signature(fn).parameters}
        topic = fn(**args)
        tier = topics.tier_of(topic) or ""
        signer = signer_of(topic) or ""
        out.append(f"| `{name}` | `{topic}` | {tier} | {signer} | {_cell(_doc(fn))} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- wire


def wire_header_reference() -> str:
    """Markdown: the envelope header's fields (``protocols.wire.envelope.Header``): wire key, name, type,
    default, constraint."""
    from protocols.wire.envelope import Header

    out = ["| wire key | field | type | default | constraint |", "|---|---|---|---|---|"]
    for name, field in Header.model_fields.items():
        key = field.alias or name
        out.append(
            f"| `{key}` | `{name}` | {_type_name(field.annotation)} | {_default(field)} | {_constraints(field)} |"
        )
    return "\n".join(out) + "\n"


def wire_kinds() -> list[str]:
    """Every message kind the envelope accepts."""
    from protocols.wire.envelope import MessageKind

    return list(get_args(MessageKind))


def wire_dtypes_reference() -> str:
    """Markdown: the ``tensors/v1`` dtype codes (``protocols.wire.payload.DTYPES``)."""
    from protocols.wire.payload import DTYPES

    out = ["| code | dtype | bytes per value |", "|---|---|---|"]
    out += [f"| {code} | `{dt.str}` ({dt.name}) | {dt.itemsize} |" for code, dt in sorted(DTYPES.items())]
    return "\n".join(out) + "\n"


def wire_constants_reference() -> str:
    """Markdown: the wire constants (magics, bounds, signature domains), read from the modules that use them."""
    from protocols.wire import chunking, envelope, payload, signed

    rows = [
        ("message magic", envelope.MAGIC, "protocols/wire/envelope.py"),
        ("largest header", f"{envelope.MAX_HEADER_BYTES} bytes", "protocols/wire/envelope.py"),
        ("message signature domain", envelope.SIGNED_DOMAIN, "protocols/wire/envelope.py"),
        ("largest payload metadata", f"{payload.MAX_META_BYTES} bytes", "protocols/wire/payload.py"),
        ("most tensor dimensions", payload.MAX_NDIM, "protocols/wire/payload.py"),
        ("chunk magic", chunking.MAGIC, "protocols/wire/chunking.py"),
        ("chunk header", f"{chunking.HEADER_BYTES} bytes + sender id + signature", "protocols/wire/chunking.py"),
        ("default chunk size", f"{chunking.DEFAULT_MAX_CHUNK} bytes", "protocols/wire/chunking.py"),
        ("reassembly timeout", f"{chunking.DEFAULT_TIMEOUT:g} s", "protocols/wire/chunking.py"),
        ("chunk signature domain", chunking.CHUNK_DOMAIN, "protocols/wire/chunking.py"),
        ("record signature domain", signed.RECORD_DOMAIN, "protocols/wire/signed.py"),
        ("largest JSON record", f"{signed.MAX_RECORD_BYTES} bytes", "protocols/wire/signed.py"),
    ]
    out = ["| what | value | defined in |", "|---|---|---|"]
    for what, value, where in rows:
        shown = f"`{value!r}`" if isinstance(value, bytes) else str(value)
        out.append(f"| {what} | {shown} | `{where}` |")
    return "\n".join(out) + "\n"


def wire_example_reference() -> str:
    """Markdown: one small ``device_result`` framed by the real encoder (unsigned), as a hex dump with its parts."""
    import numpy as np

    from protocols.wire.envelope import MAGIC, Header, encode_message
    from protocols.wire.payload import Payload, encode_payload

    payload = encode_payload(Payload({"weight": 12, "loss": 0.5}, {"b": np.array([0.5, -1.0], dtype=np.float32)}))
    header = Header(
        run="demo", kind="device_result", round=3, edge_round=1, cell="c0", sender="c0-d1",
        msg_id="9f2c51d07a3e4b18", payload_len=0,
    )  # fmt: skip
    frame = encode_message(header, payload)
    head_len = int.from_bytes(frame[4:8], "little")
    meta_len = int.from_bytes(payload[:4], "little")
    parts = [
        ("magic", frame[:4]),
        (f"header length ({head_len}, u32)", frame[4:8]),
        ("header JSON", frame[8 : 8 + head_len]),
        (f"meta length ({meta_len}, u32)", payload[:4]),
        ("meta JSON", payload[4 : 4 + meta_len]),
    ]
    rest = payload[4 + meta_len :]
    parts += [
        ("tensor count (1, u16)", rest[:2]),
        ("name length (1, u16)", rest[2:4]),
        ("name", rest[4:5]),
        ("dtype code (1: float32), ndim (1)", rest[5:7]),
        ("shape (2, u32)", rest[7:11]),
        ("data: 0.5, -1.0 (float32)", rest[11:]),
    ]
    assert frame[:4] == MAGIC and b"".join(b for _, b in parts) == frame  # the parts are the whole frame
    out = ["```text"]
    for what, data in parts:
        shown = data.decode() if what.endswith("JSON") or what in ("magic", "name") else data.hex(" ")
        out.append(f"{what:<36} {shown}")
    out += ["```", "", f"{len(frame)} bytes in all; the same message as one hex string:", "", "```text"]
    out += [frame.hex()[i : i + 96] for i in range(0, len(frame.hex()), 96)]
    out.append("```")
    return "\n".join(out) + "\n"


REFERENCES: dict[str, Callable[[], str]] = {
    "config": config_reference,
    "cli": cli_reference,
    "metrics": metrics_reference,
    "topics": topics_reference,
    "wire_header": wire_header_reference,
    "wire_dtypes": wire_dtypes_reference,
    "wire_constants": wire_constants_reference,
    "wire_example": wire_example_reference,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in REFERENCES:
        print(f"usage: python -m fedtier.docs_reference {{{'|'.join(REFERENCES)}}}", file=sys.stderr)
        return 2
    print(REFERENCES[argv[0]]())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
