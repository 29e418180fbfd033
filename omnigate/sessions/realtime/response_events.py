"""The server events that end a realtime response, in the protocol's order (sans-I/O)."""

from __future__ import annotations

from collections.abc import Callable

from omnigate.sessions.realtime.conversation import Item, Response
from omnigate.sessions.realtime.server_events import (
    AudioDone,
    ContentPartDone,
    ItemDone,
    OutputItemDone,
    ResponseDone,
    ServerEvent,
    TextDone,
    TranscriptDone,
    WirePart,
)
from omnigate.sessions.realtime.wire import wire_item, wire_response


def closing_events(
    response: Response, item: Item, event_id: Callable[[], str], previous_of: dict[str, str | None]
) -> list[ServerEvent]:
    """The events that end ``response`` (its message ``item`` and any function call cut off with it), in protocol
    order, ``response.done`` last. ``previous_of`` holds each item's predecessor for its ``conversation.item.done``."""
    part = item.content[0]
    rid, iid = response.id, item.id
    events: list[ServerEvent] = []
    for index, call in enumerate(response.outputs):
        if call.type == "function_call" and call.status == "in_progress":
            # A call cut off with its response ends incomplete; the client does not run it.
            call.status = "incomplete"
            events.append(
                OutputItemDone(event_id=event_id(), response_id=rid, output_index=index, item=wire_item(call))
            )
            if response.in_conversation:
                previous = previous_of.pop(call.id, None)
                events.append(ItemDone(event_id=event_id(), item=wire_item(call), previous_item_id=previous))
    if part.type == "output_audio":
        transcript = part.transcript or ""
        events.append(AudioDone(event_id=event_id(), response_id=rid, item_id=iid, output_index=0, content_index=0))
        events.append(
            TranscriptDone(
                event_id=event_id(),
                response_id=rid,
                item_id=iid,
                output_index=0,
                content_index=0,
                transcript=transcript,
            )
        )
        wire_part = WirePart(type="audio", transcript=transcript)
    else:
        text = part.text or ""
        events.append(
            TextDone(event_id=event_id(), response_id=rid, item_id=iid, output_index=0, content_index=0, text=text)
        )
        wire_part = WirePart(type="text", text=text)
    events.append(
        ContentPartDone(
            event_id=event_id(),
            response_id=rid,
            item_id=iid,
            output_index=0,
            content_index=0,
            part=wire_part,
        )
    )
    events.append(OutputItemDone(event_id=event_id(), response_id=rid, output_index=0, item=wire_item(item)))
    if response.in_conversation:
        previous = previous_of.pop(iid, None)
        events.append(ItemDone(event_id=event_id(), item=wire_item(item), previous_item_id=previous))
    events.append(ResponseDone(event_id=event_id(), response=wire_response(response)))
    return events
