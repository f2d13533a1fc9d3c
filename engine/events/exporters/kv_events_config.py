"""``--kv-events-config``: vLLM's ``KVEventsConfig`` (declared with the other flags in
:mod:`engine.config`, as vLLM's is in ``vllm/config/kv_events.py``), parsed from the
flag's JSON with an error that names what to change.

Standard library only: the flag is checked before torch, msgspec or zmq load.
``enable_kv_cache_events`` turns on the facts (step events carry what each cached
block holds, see :class:`~engine.events.StepEvent`); ``publisher`` says where they go:
``zmq`` (the default once events are enabled) publishes them
(:mod:`engine.events.exporters.kv_publisher`), ``null`` only records them (``--events``).
"""

from __future__ import annotations

import json
from typing import Any

from engine.config import KVEventsConfig
from engine.errors import UserError

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
FLAG = "--kv-events-config"

_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: bind a stable address (wildcard, IPv6 any, ipc,
    inproc) or port 0 (the OS picks one: nothing to connect to), connect otherwise. A
    subscriber applies it in mirror."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or endpoint.endswith(":0"))


def _type_word(types: tuple[type, ...]) -> str:
    names = {bool: "true or false", str: "a string", int: "a whole number", type(None): "null"}
    return " or ".join(names[t] for t in types)


def parse_kv_events_config(text: str, flag: str = FLAG) -> KVEventsConfig:
    """The config ``text`` (a JSON object) describes; a :class:`UserError` naming the
    field and what it must be otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag}: not valid JSON ({exc.msg} at character {exc.pos}); give an object such as "
                        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'') from None
    if not isinstance(data, dict):
        raise UserError(f"{flag}: must be a JSON object of KVEventsConfig fields, got {type(data).__name__}")
    return kv_events_config_from_dict(data, flag)


def kv_events_config_from_dict(data: dict[str, Any], flag: str = FLAG) -> KVEventsConfig:
    """Checked construction from a mapping (the flag's JSON, or a recording's config)."""
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        raise UserError(f"{flag}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                        f"KVEventsConfig has {', '.join(_TYPES)}")
    for name, value in data.items():
        types = _TYPES[name]
        # bool is an int in Python: a count given as true is refused, not read as 1
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise UserError(f"{flag}: {name} must be {_type_word(types)}, got {json.dumps(value)}")
    config = KVEventsConfig(**data)
    if config.publisher not in PUBLISHERS:
        raise UserError(f"{flag}: publisher {config.publisher!r}: use one of {', '.join(PUBLISHERS)}")
    for name in ("endpoint", "replay_endpoint"):
        endpoint = getattr(config, name)
        if endpoint is not None and not endpoint.startswith(ENDPOINT_SCHEMES):
            raise UserError(f"{flag}: {name} {endpoint!r}: a ZMQ address such as tcp://*:5557 "
                            f"(schemes {', '.join(ENDPOINT_SCHEMES)})")
    for name in ("buffer_steps", "max_queue_size"):
        if getattr(config, name) <= 0:
            raise UserError(f"{flag}: {name} must be positive, got {getattr(config, name)}")
    if config.hwm < 0:
        raise UserError(f"{flag}: hwm must be 0 (no limit) or positive, got {config.hwm}")
    # the same address twice cannot be bound twice (a wildcard port ":*" binds two free ports)
    if (config.publishes and config.replay_endpoint == config.endpoint
            and not config.endpoint.endswith((":*", ":0"))):
        raise UserError(f"{flag}: endpoint and replay_endpoint are both {config.endpoint!r}; give two addresses")
    return config
