"""WebRTC transport (aiortc): ``POST /v1/realtime/calls`` answers an SDP offer; the call is a speech session whose
audio goes out on an Opus track and whose control events travel on the ``speech`` data channel."""
