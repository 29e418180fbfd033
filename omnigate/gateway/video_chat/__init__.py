"""Live video chat: ``WS /v1/video/chat/stream`` and ``POST /v1/video/chat/calls`` over one session core."""
