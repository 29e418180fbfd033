"""Video generation: ``WS /v1/realtime/video`` (a prompt in, fragmented MP4 out), its wire protocol and the one
generation from ``video.create`` to ``video.done`` that the WebSocket and the WebRTC data channel both carry."""
