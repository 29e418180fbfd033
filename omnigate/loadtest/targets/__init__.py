"""Load-test targets by name.

Built-in targets are imported only when chosen, so a target with heavy client dependencies (a WebRTC peer) costs
nothing for runs that do not use it. Other packages add targets through the ``omnigate.loadtest.targets`` entry
point group (``name = "package.module:TargetClass"``) or by calling :func:`register_target`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from omnigate.loadtest.targets.base import SessionSettings, Target

ENTRY_POINT_GROUP = "omnigate.loadtest.targets"

_BUILTIN: dict[str, str] = {
    "ws-speech": "omnigate.loadtest.targets.ws_speech:WsSpeechTarget",
    "http-speech": "omnigate.loadtest.targets.http_speech:HttpSpeechTarget",
    "webrtc": "omnigate.loadtest.targets.webrtc:WebRtcTarget",
    "realtime": "omnigate.loadtest.targets.realtime:RealtimeTarget",
    "realtime-webrtc": "omnigate.loadtest.targets.realtime_webrtc:RealtimeWebRtcTarget",
    "robot": "omnigate.loadtest.targets.robot:RobotTarget",
    "video-chat": "omnigate.loadtest.targets.video_chat:VideoChatTarget",
}

_registered: dict[str, type[Target]] = {}


def register_target(target: type[Target]) -> type[Target]:
    """Make ``target`` selectable by its ``kind`` (usable as a class decorator)."""
    _registered[target.kind] = target
    return target


def target_kinds() -> list[str]:
    """Every selectable target name."""
    names = set(_BUILTIN) | set(_registered) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def target_class(kind: str) -> type[Target]:
    """The target class for ``kind``; raises ``ValueError`` for an unknown name."""
    if kind in _registered:
        return _registered[kind]
    reference = _BUILTIN.get(kind)
    if reference is None:
        for entry_point in entry_points(group=ENTRY_POINT_GROUP, name=kind):
            reference = entry_point.value
    if reference is None:
        raise ValueError(f"unknown target {kind!r}; choose one of {', '.join(target_kinds())}")
    module_name, _, class_name = reference.partition(":")
    loaded = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(loaded, type) and issubclass(loaded, Target)):
        raise ValueError(f"target {kind!r} ({reference}) is not a Target subclass")
    return loaded


__all__ = ["SessionSettings", "Target", "register_target", "target_class", "target_kinds"]
