"""Robot policies: ``WS /v1/realtime/robot/openpi``, openpi's websocket policy protocol over one batched policy."""
